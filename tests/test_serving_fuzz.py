"""Fuzzing the serving codec and validation (no Ray): whatever bytes or documents arrive,
`apex_bdq.serving` either accepts them as well-formed observations or raises RequestError
with a 4xx status — never another exception (which Serve would answer with a 500)."""

import msgpack
import numpy as np
import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apex_bdq.config import SimConfig
from apex_bdq.networks import NetConfig
from apex_bdq.serving import JSON, MSGPACK, RequestError, check_output, decode_body, parse_decide, parse_feedback

NET = NetConfig.for_sim(SimConfig())

scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2 ** 70), max_value=2 ** 70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=5), st.binary(max_size=12))
json_like = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=6),
                                                          st.dictionaries(st.text(max_size=8), inner, max_size=5)),
                         max_leaves=40)
packed = st.fixed_dictionaries({"dtype": st.sampled_from(["<f4", "<f8", "<i8", "|b1", "<U3", "bogus", 7]),
                                "shape": st.lists(st.integers(-3, 20), max_size=5) | st.text(max_size=3),
                                "data": st.binary(max_size=256) | st.integers()})


def _macro_like():
    return st.one_of(json_like, packed,
                     st.lists(st.floats(allow_nan=True, allow_infinity=True), min_size=NET.macro_features,
                              max_size=NET.macro_features))


decide_docs = st.fixed_dictionaries({}, optional={"macro": _macro_like(), "micro": json_like | packed,
                                                  "include_q": scalars, "extra": scalars})


def _check(doc) -> None:
    try:
        macro, micro, include_q = parse_decide(doc, NET)
    except RequestError as e:
        assert 400 <= e.status < 500 and e.message
        return
    assert macro.dtype == np.float32 and macro.shape[1:] == (NET.macro_features,)
    assert micro.shape[0] == macro.shape[0] and np.isfinite(macro).all() and np.isfinite(micro).all()
    assert isinstance(include_q, bool)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(decide_docs)
def test_any_decide_document_is_accepted_or_refused_with_a_4xx(doc):
    _check(doc)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.sampled_from([JSON, MSGPACK, "text/plain", "", None, "application/json; x"]))
def test_any_body_bytes_decode_or_get_a_4xx(body, ct):
    try:
        doc = decode_body(body, ct)
    except RequestError as e:
        assert 400 <= e.status < 500
        return
    _check(doc)


@settings(max_examples=200, deadline=None)
@given(json_like)
def test_documents_survive_both_codecs(doc):
    try:
        body = msgpack.packb(doc, use_bin_type=True)
    except OverflowError:  # msgpack has no integers beyond 64 bits: nothing a client could send
        body = None
    if body is not None:
        try:
            _check(decode_body(body, MSGPACK))
        except RequestError as e:
            assert 400 <= e.status < 500
    try:
        body = orjson.dumps(doc)
    except (TypeError, orjson.JSONEncodeError):
        return
    try:
        _check(decode_body(body, JSON))
    except RequestError as e:
        assert 400 <= e.status < 500


@settings(max_examples=300, deadline=None)
@given(st.fixed_dictionaries({}, optional={"pairs": json_like, "segments": json_like, "x": scalars}))
def test_any_feedback_document_is_accepted_or_refused_with_a_4xx(doc):
    try:
        pairs, segments = parse_feedback(doc, NET)
    except RequestError as e:
        assert 400 <= e.status < 500 and e.message
        return
    assert pairs and all(p["label"] in (0.0, 0.5, 1.0) for p in pairs)


def test_finite_inputs_that_overflow_the_network_are_refused():
    """Observations near float32's limit pass validation but can overflow the forward pass:
    the answer is a 422, not NaN Q-values and arbitrary actions."""
    import torch
    from apex_bdq.networks import BDQNetwork
    torch.manual_seed(0)
    net = BDQNetwork(NET).eval()
    with torch.no_grad():
        for p in net.parameters():
            p.abs_()  # all-positive weights: huge positive inputs must overflow
        q = net(torch.full((1, NET.macro_features), 3e38), torch.full((1, NET.num_classes, NET.history,
                                                                         NET.micro_features), 3e38)).numpy()
    try:
        check_output(q)
    except RequestError as e:
        assert e.status == 422 and "out of range" in e.message
    else:
        raise AssertionError(f"Q-values {q.ravel()[:4]} passed")
    check_output(np.zeros((2, NET.num_branches, NET.sub_actions), dtype=np.float32))  # finite: accepted
