"""The fuzz harnesses (fuzz/, docs/fuzzing.md): a bounded run of each, the checks they rely on,
and the findings they made.

The bounded runs are the CI part of the fuzzing: seconds each, every harness from the golden
vectors and the committed corpus, zero findings required. The planted-bug runs show that a
finding does come out of the runner (a Python exception, a read past a frame, an ASan report),
so that zero findings means something. The findings' regression tests feed the exact bytes.
"""

from __future__ import annotations

import collections
import json
import random
import subprocess
import textwrap

import pytest

import protocol
from protocol import OPS

pytest.importorskip("atheris", reason="atheris is not installed (pip install -e '.[dev]')")

from fuzz import HARNESSES, known, structure  # noqa: E402
from fuzz import decoder as decoder_harness  # noqa: E402
from fuzz import framing as framing_harness  # noqa: E402
from fuzz import legacy as legacy_harness  # noqa: E402
from fuzz import native_build  # noqa: E402
from fuzz import native_step as native_harness  # noqa: E402
from fuzz.checks import Finding, check_error_reply, check_request, vector_frames  # noqa: E402
from fuzz.mpack import pack, unpack  # noqa: E402
from fuzz.runner import run_harness  # noqa: E402

# Seconds of fuzzing per harness in the bounded run (about 20 s in all, plus each process's start
# and, on a fresh checkout, the sanitized native build), and a cap on executions. A smoke test of
# each harness: the long runs are `python -m fuzz` (docs/fuzzing.md).
BOUNDED_SECONDS = {"decoder": 6, "legacy": 3, "native_step": 8, "framing": 3}
BOUNDED_RUNS = 500_000
# Fewer executions than this means the harness hardly ran: far below what any of them does in
# its seconds even on a loaded machine, far above the seeds alone (about 50).
MIN_EXECUTIONS = 300


def _quiet(line: str) -> None:
    print(line)


def _sanitized_plan_or_skip():
    plan = native_build.plan()
    if not plan.sanitized:
        pytest.skip(f"no sanitized build of the native step parser: {plan.reason}")
    return plan


@pytest.mark.parametrize("name", list(HARNESSES))
def test_a_bounded_run_of_the_harness_finds_nothing(name):
    result = run_harness(name, runs=BOUNDED_RUNS, seconds=BOUNDED_SECONDS[name], say=_quiet)
    if result.get("unavailable"):
        pytest.skip(f"{name} cannot run here: {result['unavailable']}")
    assert not result["findings"], f"{name} found (log {result['log']}): {result['findings']}"
    assert result["returncode"] == 0, f"{name} exited {result['returncode']} (log {result['log']})"
    assert result["info"].get("harness") == name, f"no FUZZ-INFO line from {name} (log {result['log']})"
    assert result["executions"] >= MIN_EXECUTIONS, result
    stats = result["stats"]
    if name == "native_step":
        # The run reached the step itself, of both kinds of session, not only the parser's refusals.
        assert stats.get("parsed", 0) > 0 and stats.get("stepped", 0) > 0 and stats.get("ssd stepped", 0) > 0, stats
        assert result["info"]["asan"] == result["sanitized"], result["info"]
    elif name in ("decoder", "legacy"):
        accepted = {k: v for k, v in stats.items() if k != "executions" and not k.startswith(("error", "legacy error",
                                                                                                "known"))}
        assert sum(accepted.values()) > 0, f"{name} accepted no request in {stats}"
    else:
        assert stats.get("bodies", 0) > 0 and stats.get("too large", 0) > 0, stats


def test_the_command_fuzzes_harnesses_side_by_side_and_records_each(tmp_path, capsys):
    """`python -m fuzz legacy,decoder --jobs 2`: both run, recorded in the order given (the order
    they start in), and the record says how they were run."""
    from fuzz.__main__ import main

    out = tmp_path / "fuzz.json"
    status = main(["legacy,decoder", "--runs", "200", "--jobs", "2", "--json", str(out)])
    results = json.loads(out.read_text())["results"]
    assert status == 0, capsys.readouterr().out
    assert list(results["harnesses"]) == ["legacy", "decoder"]
    assert results["jobs"] == 2 and results["wall_seconds"] > 0
    assert results["total_executions"] == sum(h["executions"] for h in results["harnesses"].values())
    assert all(h["executions"] >= 200 for h in results["harnesses"].values()), results


@pytest.mark.parametrize("argv, message", [
    pytest.param(["all", "--runs", "10", "--jobs", "0"], "--jobs: expected a count of 1 or more, got 0", id="no-jobs"),
    pytest.param(["decoder,nope", "--runs", "10"], "harness: expected decoder, legacy, native_step, framing or all, "
                                                   "got 'nope'", id="unknown-harness"),
    pytest.param(["decoder,decoder", "--runs", "10"], "expected each harness once, got 'decoder,decoder'", id="twice"),
    pytest.param(["decoder,legacy", "--replay", "x"], "--replay takes one harness", id="replay-of-two"),
])
def test_the_command_refuses_what_it_cannot_run(argv, message, capsys):
    from fuzz.__main__ import main

    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err


def test_the_native_step_parser_is_fuzzed_under_asan_ubsan_and_libfuzzer():
    """The sanitized build exists and is what its harness loads; where clang is missing this skips
    with the reason (and CI, where nothing may skip, fails)."""
    plan = _sanitized_plan_or_skip()
    library = plan.library.read_bytes()
    assert b"__asan_report_load" in library and b"__ubsan_handle" in library, "not sanitized"
    assert b"__sanitizer_cov_8bit_counters_init" in library, "no libFuzzer coverage instrumentation"
    assert "asan_with_fuzzer.so" in plan.env["LD_PRELOAD"]


# -- the runner reports what goes wrong ------------------------------------------------------

_PLANTED_EXCEPTION = '''
"""A harness with a planted bug: a body starting with 0x81 raises."""
MAX_LEN = 64
mutator = None

def setup():
    return {"target": "a planted bug"}

def seeds():
    return [b"\\x80", b"\\x81\\xa2op\\xa4ping"]

def one_input(data):
    if data[:1] == b"\\x81":
        raise ValueError("planted bug")
'''

_PLANTED_FINDING = '''
"""A harness with a planted broken property: a body starting with 0x81 raises the harnesses'
own Finding, as every check of fuzz.checks does."""
from fuzz.checks import Finding

MAX_LEN = 64
mutator = None

def setup():
    return {"target": "a planted finding"}

def seeds():
    return [b"\\x80", b"\\x81\\xa2op\\xa4ping"]

def one_input(data):
    if data[:1] == b"\\x81":
        raise Finding("planted property broken")
'''

_PLANTED_OVERREAD = '''
"""A harness with a planted bug: it reads one byte past the frame, as placed for native_step."""
import ctypes

import numpy as np
from fuzz.native_step import GuardedPlacement

MAX_LEN = 64
mutator = None
_placement = GuardedPlacement(MAX_LEN)

def setup():
    return {"target": "a planted read past the frame"}

def seeds():
    return [b"abc"]

def one_input(data):
    address = np.frombuffer(_placement.after(data), dtype=np.uint8).ctypes.data
    ctypes.string_at(address, len(data) + 1)
'''

_PLANTED_HEAP_OVERFLOW_C = r'''
#include <stdlib.h>
#include <string.h>
int planted_overread(const unsigned char *data, size_t n) {
  unsigned char *copy = malloc(n);
  memcpy(copy, data, n);
  int last = copy[n];  /* one past the end of the heap block */
  free(copy);
  return last;
}
'''

_PLANTED_HEAP_OVERFLOW = '''
"""A harness with a planted bug in sanitized C: a heap read one past a block."""
import ctypes
import os

MAX_LEN = 64
NATIVE_BUILD = True  # run with the native step harness's sanitizer runtime preloaded
mutator = None
_library = None

def setup():
    # Loaded here, in the harness's process: only there is the ASan runtime it needs.
    global _library
    _library = ctypes.CDLL(os.path.join(os.path.dirname(__file__), "planted_overread.so"))
    return {"target": "a planted heap overflow"}

def seeds():
    return [b"abcd"]

def one_input(data):
    if data:
        _library.planted_overread(data, len(data))
'''


def _plant(tmp_path, monkeypatch, name: str, source: str) -> dict:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    return {"PYTHONPATH": str(tmp_path)}


def _single_finding(result) -> dict:
    assert len(result["findings"]) == 1, result
    return result["findings"][0]


def test_a_python_exception_in_a_harness_is_a_finding_with_its_input(tmp_path, monkeypatch):
    env = _plant(tmp_path, monkeypatch, "planted_exception", _PLANTED_EXCEPTION)
    result = run_harness("planted_exception", runs=2000, seconds=30, env=env, say=_quiet)
    finding = _single_finding(result)
    assert finding["kind"] == "crash"
    with open(finding["input"], "rb") as f:
        assert f.read()[:1] == b"\x81"
    assert any("ValueError: planted bug" in s for s in finding["signatures"]), finding


def test_a_broken_property_is_a_finding_named_by_its_message(tmp_path, monkeypatch):
    """A check's Finding (atheris prints it as "Finding: ...", no module, no Error suffix) is
    named in the result, as other exceptions are: what property broke, not only an input."""
    env = _plant(tmp_path, monkeypatch, "planted_finding", _PLANTED_FINDING)
    result = run_harness("planted_finding", runs=2000, seconds=30, env=env, say=_quiet)
    finding = _single_finding(result)
    assert finding["kind"] == "crash"
    assert any("Finding: planted property broken" in s for s in finding["signatures"]), finding


def test_a_read_past_the_frame_faults_on_the_guard_page(tmp_path, monkeypatch):
    env = _plant(tmp_path, monkeypatch, "planted_overread", _PLANTED_OVERREAD)
    result = run_harness("planted_overread", runs=2000, seconds=30, env=env, say=_quiet)
    finding = _single_finding(result)
    assert finding["kind"] == "crash"
    assert any("deadly signal" in s or "SEGV" in s or "AddressSanitizer" in s for s in finding["signatures"]), finding


def test_a_heap_overflow_in_sanitized_code_is_an_asan_finding(tmp_path, monkeypatch):
    _sanitized_plan_or_skip()
    (tmp_path / "planted.c").write_text(_PLANTED_HEAP_OVERFLOW_C)
    subprocess.run([native_build.clangxx(), "-x", "c", "-O1", "-g", "-fsanitize=address", "-fPIC", "-shared",
                    str(tmp_path / "planted.c"), "-o", str(tmp_path / "planted_overread.so")], check=True)
    env = _plant(tmp_path, monkeypatch, "planted_heap_overflow", _PLANTED_HEAP_OVERFLOW)
    result = run_harness("planted_heap_overflow", runs=2000, seconds=30, env=env, say=_quiet)
    finding = _single_finding(result)
    assert any("AddressSanitizer: heap-buffer-overflow" in s for s in finding["signatures"]), finding


# -- the checks and the structure the harnesses rely on --------------------------------------

def test_every_op_of_the_protocol_is_generated_valid_for_some_seed():
    """New ops and kinds in protocol.OPS are generated without a change to fuzz.structure; a
    kind it cannot make valid values of fails here."""
    for op in OPS:
        for multipart in (False, True):
            for seed in range(60):
                message = structure.request(random.Random(seed), op, multipart=multipart)
                try:
                    request = protocol.decode_request(message.body, message.buffers)
                except protocol.ProtocolError:
                    continue
                assert request.op == op
                break
            else:
                pytest.fail(f"no valid {op} request (multipart {multipart}) from 60 seeds")


def test_every_legacy_form_is_generated_valid_for_some_seed():
    accepted = set()
    for seed in range(200):
        body = structure.legacy_request(random.Random(seed))
        try:
            request = protocol.decode_request(body)
        except protocol.ProtocolError:
            continue
        form = "declared shapes" if b"x_shape" in body else "dims"
        accepted.add(request.op if request.op != "scan" else f"scan with {form}")
    assert accepted == {"ping", "info", "scan with dims", "scan with declared shapes"}


def test_generated_step_requests_are_taken_by_the_native_parser():
    from bridge import native
    from scan_kernels.errors import BackendUnavailable

    try:
        module = native._module()
    except BackendUnavailable as exc:
        pytest.skip(f"native step path unavailable: {exc}")
    frames = [structure.step_request(random.Random(seed)) for seed in range(200)]
    taken = [f for f in frames if module.parse(f) is not None]
    assert len(taken) >= 150, f"only {len(taken)} of 200 generated step requests parsed natively"
    for frame in taken:
        native_harness.check_against_decoder(module.parse(frame), frame)


def _decoded(body):
    try:
        return protocol.decode_request(body)
    except protocol.ProtocolError as exc:
        return exc.code


def test_every_vector_request_decodes_alike_in_any_encoding_the_writer_chooses():
    """fuzz.mpack's non-minimal encodings are ones the decoder must read alike (SPEC §3), and the
    writer writes back what its reader read."""
    for name, frame in vector_frames(multipart=False):
        body = frame[4:]
        try:
            tree = unpack(body)
        except ValueError:
            continue  # the vectors that are not one msgpack value on purpose
        for seed in range(8):
            again = pack(tree, random.Random(seed))
            assert unpack(again) == tree, name
            assert _decoded(again) == _decoded(body), name


def test_the_fast_and_checked_paths_disagreeing_is_a_finding(monkeypatch):
    _, frame = next(v for v in vector_frames() if v[0] == "step_groups")
    body = frame[4:]
    check_request(protocol.decode_request(body), body, [])  # agrees as shipped
    from protocol import decode as decode_module

    checked = decode_module._decode_v1_checked

    def reads_another_session(top, buffers):
        request = checked(top, buffers)
        request.args["session"] = "another session"
        return request

    monkeypatch.setattr(decode_module, "_decode_v1_checked", reads_another_session)
    with pytest.raises(Finding, match="disagree"):
        check_request(protocol.decode_request(body), body, [])


def test_an_error_reply_that_does_not_read_back_is_a_finding():
    error = protocol.InvalidArgument("args.x", "a tensor", "nothing", request_id=7)
    check_error_reply(error)
    error.code = "no_such_code"
    with pytest.raises(Finding, match="not a wire code"):
        check_error_reply(error)


def test_the_framer_model_catches_a_lost_frame(monkeypatch):
    ping = dict(vector_frames(multipart=False))["ping"]
    # max_frame_size 255; k = 1 (odd: the stream goes through feed()), one read size; two frames
    seed = bytes([255, 1, 7]) + ping + ping
    framing_harness.one_input(seed)

    class LosesTheLastFrame(protocol.FrameAssembler):
        def feed(self, data):
            return super().feed(data)[:-1]

    monkeypatch.setattr(framing_harness, "FrameAssembler", LosesTheLastFrame)
    with pytest.raises(Finding, match="events"):
        framing_harness.one_input(seed)


def test_every_framing_seed_reads_frames_on_its_path():
    """Each seed's stream starts after its k % 8 read sizes, as one_input reads it: a seed for
    the feed() path (k odd) must carry its read-size bytes too, or its stream is shifted a byte
    and not one frame of it is read."""
    for seed in framing_harness.seeds():
        max_frame_size, k = seed[0], seed[1]
        events, _ = framing_harness.model(seed[2 + k % 8:], max_frame_size)
        assert events, (seed[:8], k)
    assert any(seed[1] & 1 for seed in framing_harness.seeds()), "no seed for the feed() path"


def test_the_native_harness_catches_a_parse_the_decoder_disagrees_with():
    _, frame = next(v for v in vector_frames() if v[0] == "step_groups")
    body = frame[4:]
    request = protocol.decode_request(body)

    class Parsed:
        op = "step"
        id = request.id
        session = "another session"
        handles = {}

    with pytest.raises(Finding, match="session"):
        native_harness.check_against_decoder(Parsed(), body)
    Parsed.session = request.args["session"]
    Parsed.op = "model_step"
    with pytest.raises(Finding, match="as a model_step"):
        native_harness.check_against_decoder(Parsed(), body)


@pytest.mark.parametrize("name", ["decoder", "legacy", "native_step"])
def test_mutators_keep_inputs_within_the_size_libfuzzer_allows(name):
    harness = {"decoder": decoder_harness, "legacy": legacy_harness, "native_step": native_harness}[name]

    def mutate_bytes(data, max_size):
        return bytes(data[:max_size])

    inputs = harness.seeds()
    for seed in range(300):
        out = harness.mutator(inputs[seed % len(inputs)], 512, seed, mutate_bytes=mutate_bytes)
        assert len(out) <= 512
        inputs.append(out)


# -- findings ------------------------------------------------------------------------------

LIMITS_OPS = [op for op, spec in OPS.items() if any(arg.kind == "limits" for arg in spec.values())]


@pytest.mark.parametrize("op", LIMITS_OPS)
def test_a_dt_limit_holding_a_str_that_is_not_utf8_is_invalid_argument(op):
    """Found by the decoder harness: Reader.limits decoded the array outside Reader._decode, so a
    str in it that was not UTF-8 escaped as UnicodeDecodeError (internal_error, id nil)."""
    # {"id": 1, "op": <op>, "args": {"dt_limit": [0, <str: the byte 0xad>]}}, as the harness found it
    body = b"\x83\xa2id\x01\xa2op" + pack(op) + b"\xa4args\x81\xa8dt_limit\x92\x00\xa1\xad"
    with pytest.raises(protocol.InvalidArgument) as raised:
        protocol.decode_request(body)
    assert raised.value.detail["field"] == "args.dt_limit[1]" and raised.value.request_id == 1


def _planted_decoder_bug(body, buffers=()):
    raise KeyError("planted decoder bug")


@pytest.mark.parametrize("harness, call", [
    pytest.param(decoder_harness, lambda: decoder_harness.check_message(b"\x80", []), id="decoder"),
    pytest.param(legacy_harness, lambda: legacy_harness.one_input(b"\x80"), id="legacy"),
])
def test_an_exception_not_a_known_finding_comes_out_of_the_harness(monkeypatch, harness, call):
    """The filter of known findings lets every other exception through (found in review: with
    none recorded, a filter that kept them all passed every test, and a run hid every crash)."""
    monkeypatch.setattr(harness, "decode_request", _planted_decoder_bug)
    with pytest.raises(KeyError, match="planted decoder bug"):
        call()


def test_a_known_finding_is_counted_only_where_it_was_recorded(monkeypatch):
    planted = known.KnownFinding("planted", KeyError, "tests/test_fuzz.py", "_planted_decoder_bug", b"", "")
    monkeypatch.setattr(known, "KNOWN", (planted,))
    tally = collections.Counter()
    try:
        _planted_decoder_bug(b"")
    except KeyError as exc:
        known.count_or_raise(exc, tally)
    assert tally == {"known planted": 1}
    with pytest.raises(KeyError):  # the same type raised elsewhere is not that finding
        try:
            {}["elsewhere"]
        except KeyError as exc:
            known.count_or_raise(exc, tally)


def test_known_findings_reproduce_as_recorded():
    """The harnesses count a fuzz.known finding instead of stopping: each entry's bytes still
    raise its exception where it says. Once the bug is fixed this fails: delete the entry (and
    its regression test's xfail mark)."""
    for finding in known.KNOWN:
        with pytest.raises(finding.exception) as raised:
            protocol.decode_request(finding.reproducer)
        assert known.match(raised.value) is finding, f"{finding.name}: raised elsewhere now"
