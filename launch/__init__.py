"""Entry points (`python -m launch.NAME`). Importing this package turns Ray token
authentication on for them, before Ray is imported (apex_bdq.ray_util.ray_auth_default)."""

from apex_bdq.ray_util import ray_auth_default

ray_auth_default()
