"""Fuzzing the serving codec and validation (no Ray): whatever bytes or documents arrive,
`apex_bdq.serving` either accepts them as well-formed observations or raises RequestError
with a 4xx status — never another exception (which Serve would answer with a 500) — and
never allocates more than a bounded amount on the way.

Examples per property: APEX_BDQ_FUZZ_EXAMPLES (default 300; the recorded fuzz run in
docs/hardening.md used 10,000 per property:
`APEX_BDQ_FUZZ_EXAMPLES=10000 pytest tests/test_serving_fuzz.py`)."""

import os
import tracemalloc

import msgpack
import numpy as np
import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apex_bdq.config import SimConfig
from apex_bdq.networks import NetConfig
from apex_bdq import serving as S
from apex_bdq.serving import JSON, MSGPACK, RequestError, check_output, decode_body, parse_decide, parse_feedback

NET = NetConfig.for_sim(SimConfig())
N = int(os.environ.get("APEX_BDQ_FUZZ_EXAMPLES", "300"))

# Adversarial metadata: every dtype spelling numpy knows and some it does not; extreme,
# negative, overflowing and mismatched shapes; huge ids; deep nesting.
DTYPES = ["<f4", ">f4", "=f4", "|f4", "<f8", "<f2", "<f1", "|f1", "f1", "<u3", "<i8", "<i4", "|i1", "<u8", "|u1", "|b1", "?", "b", "B", "h", "H",
          "i", "I", "l", "L", "q", "Q", "e", "f", "d", "g", "F", "D", "G", "S", "S0", "U", "<U3", "V", "V8", "O", "M",
          "<M8[s]", "m", "float32", "int64", "float", "int", "f4,f4", "(2,)f4", "bogus", "", " <f4", "<f4 ",
          "<f16", "<i0", None, 7, 4.5, True, [], {}, b"<f4"]
BIG = [-(2 ** 63), -1, 0, 1, 2, 3, 2 ** 16, 2 ** 31 - 1, 2 ** 31, 2 ** 32, 2 ** 62, 2 ** 63 - 1, 2 ** 64 - 1]
shape_ints = st.one_of(st.integers(-3, 40), st.sampled_from(BIG))
adversarial_packed = st.fixed_dictionaries(
    {"dtype": st.sampled_from(DTYPES),
     "shape": st.lists(shape_ints, max_size=10) | st.sampled_from([None, "2,3", 5, [[2]], [1.5], [True]]),
     "data": st.binary(max_size=512) | st.sampled_from([None, 0, "abc", [1, 2]])},
    optional={"extra": st.integers()})
huge_text = st.one_of(st.text(max_size=8), st.integers(0, 20000).map(lambda n: "x" * n))


def nested(depth: int):
    doc = 0.0
    for _ in range(depth):
        doc = [doc]
    return doc

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


@settings(max_examples=N, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(decide_docs)
def test_any_decide_document_is_accepted_or_refused_with_a_4xx(doc):
    _check(doc)


@settings(max_examples=N, deadline=None)
@given(st.binary(max_size=300), st.sampled_from([JSON, MSGPACK, "text/plain", "", None, "application/json; x"]))
def test_any_body_bytes_decode_or_get_a_4xx(body, ct):
    try:
        doc = decode_body(body, ct)
    except RequestError as e:
        assert 400 <= e.status < 500
        return
    _check(doc)


@settings(max_examples=N, deadline=None)
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


@settings(max_examples=N, deadline=None)
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


def _both_codecs(doc):
    """The document as each client could send it (msgpack, JSON where it is JSON)."""
    try:
        yield msgpack.packb(doc, use_bin_type=True), MSGPACK
    except (OverflowError, TypeError, ValueError):
        pass
    try:
        yield orjson.dumps(doc), JSON
    except (TypeError, orjson.JSONEncodeError):
        pass


def _through_the_wire(doc, parse) -> None:
    for body, ct in _both_codecs(doc):
        try:
            out = parse(decode_body(body, ct), NET)
        except RequestError as e:
            assert 400 <= e.status < 500 and e.message
            continue
        if parse is parse_decide:
            macro, micro, _ = out
            assert macro.shape[1:] == (NET.macro_features,) and np.isfinite(micro).all()


@settings(max_examples=N, deadline=None, suppress_health_check=list(HealthCheck))
@given(macro=adversarial_packed | _macro_like(), micro=adversarial_packed | json_like,
       include_q=scalars, depth=st.integers(0, 3000))
def test_adversarial_decide_metadata_gets_a_4xx(macro, micro, include_q, depth):
    doc = {"macro": macro, "micro": micro if depth < 50 else nested(depth), "include_q": include_q}
    _through_the_wire(doc, parse_decide)
    # nesting deeper than the encoders write (raw bytes): each decoder's depth limit answers 400
    for body, ct in ((b'{"micro": ' + b"[" * depth + b"]" * depth + b"}", JSON),
                     (b"\x81\xa5micro" + b"\x91" * depth + b"\xc0", MSGPACK)):
        try:
            parse_decide(decode_body(body, ct), NET)
        except RequestError as e:
            assert 400 <= e.status < 500


segment_docs = st.fixed_dictionaries(
    {"id": huge_text | scalars, "macro": adversarial_packed | json_like, "micro": adversarial_packed | json_like,
     "action": adversarial_packed | json_like,
     "metrics": st.dictionaries(st.sampled_from(["overload", "unfairness", "slo_violation", "x"]), scalars,
                                max_size=4) | scalars},
    optional={"source": huge_text | scalars})
pair_docs = st.fixed_dictionaries({"a": huge_text | scalars, "b": huge_text | scalars},
                                  optional={"label": scalars | st.sampled_from(["a", "b", "tie", 0.5])})


@settings(max_examples=N, deadline=None, suppress_health_check=list(HealthCheck))
@given(pairs=st.lists(pair_docs, max_size=4) | st.integers(0, 3000).map(lambda n: [{"a": "s", "b": "t"}] * n),
       segments=st.lists(segment_docs, max_size=3) | scalars)
def test_adversarial_feedback_gets_a_4xx(pairs, segments):
    _through_the_wire({"pairs": pairs, "segments": segments}, parse_feedback)


def _peak_mb(fn) -> float:
    tracemalloc.start()
    try:
        fn()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak / 2 ** 20


def _refused(body: bytes, ct: str, parse=parse_decide) -> RequestError:
    try:
        parse(decode_body(body, ct), NET)
    except RequestError as e:
        return e
    raise AssertionError("accepted")


def test_amplifying_bodies_are_refused_before_they_cost_memory():
    # the issue's cases: 4 MB of msgpack empty arrays (~257 MB of objects unbounded), 12 MB of
    # JSON empty arrays (~256 MB): refused, with a bounded peak of allocations on the way
    mp = msgpack.packb([[[] for _ in range(65536)] for _ in range(64)])
    js = b"[" + b"[]," * (4 << 20) + b"[]]"
    assert len(mp) > 4_000_000 and len(js) > 12_000_000
    for body, ct in ((mp, MSGPACK), (js, JSON)):
        err = []
        peak = _peak_mb(lambda: err.append(_refused(body, ct)))
        assert err[0].status == 413 and "values" in err[0].message
        assert peak < 120, f"{ct}: {peak:.0f} MB allocated before the refusal"
    # a body under the value budget still decodes (a JSON batch of 1,000 shards)
    rng = np.random.default_rng(0)
    ok = orjson.dumps({"macro": rng.random((1000, NET.macro_features)).tolist(),
                       "micro": rng.random((1000, NET.num_classes, NET.history, NET.micro_features)).tolist()})
    assert parse_decide(decode_body(ok, JSON), NET)[0].shape == (1000, NET.macro_features)


def test_the_issues_packed_array_cases_get_a_422():
    micro = np.zeros((1, NET.num_classes, NET.history, NET.micro_features), np.float32).tolist()
    cases = [({"dtype": "<f4", "shape": [0, 2 ** 63 - 1], "data": b""}, "packed shape must be"),
             ({"dtype": None, "shape": [1, NET.macro_features], "data": b"\0" * 8 * NET.macro_features},
              "packed dtype must be"),
             ({"dtype": "<f8", "shape": [2 ** 31, 2 ** 31, 0], "data": b""}, "packed shape must be"),
             ({"dtype": "O", "shape": [1], "data": b"\0" * 8}, "packed dtype must be")]
    for packed, needle in cases:
        e = _refused(msgpack.packb({"macro": packed, "micro": micro}, use_bin_type=True), MSGPACK)
        assert e.status == 422 and needle in e.message, e.message


def test_feedback_requests_are_capped():
    many = {"pairs": [{"a": f"s{i}", "b": f"t{i}"} for i in range(S.MAX_PAIRS + 1)]}
    e = _refused(orjson.dumps(many), JSON, parse_feedback)
    assert e.status == 413 and f"at most {S.MAX_PAIRS}" in e.message
    e = _refused(orjson.dumps({"pairs": [{"a": "x" * (S.MAX_ID + 1), "b": "y"}]}), JSON, parse_feedback)
    assert e.status == 422 and "at most" in e.message
    segs = {"pairs": [{"a": "s", "b": "t"}], "segments": [{"id": "s"}] * (S.MAX_SEGMENTS + 1)}
    e = _refused(orjson.dumps(segs), JSON, parse_feedback)
    assert e.status == 413 and f"at most {S.MAX_SEGMENTS}" in e.message
    e = _refused(msgpack.packb({"pairs": [{"a": "s" * (S.MAX_STR + 1), "b": "t"}]}), MSGPACK, parse_feedback)
    assert e.status == 400 and "strings" in e.message
