"""The server's parts without a server: the answer stream (stop strings, max_tokens, held-back text), the policy and
max_tokens rules, strict request bodies, the Prometheus rendering."""

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install tracelock[serve])")

import tracelock  # noqa: E402
from tracelock.serve.config import ServeConfig, parse_served_policies  # noqa: E402
from tracelock.serve.metrics import Metrics  # noqa: E402
from tracelock.serve.protocol import APIError, ChatRequest, CompletionRequest, parse_body  # noqa: E402
from tracelock.serve.stream import TextStream  # noqa: E402

ANSWER = "Ben starts with 2 stickers.\nThen he has 2 - 2 = 0.\n#### 0"


@pytest.fixture(scope="module")
def tok():
    return tracelock.load_tokenizer("testbed")


def _feed(tok, stream, ids, ended=True):
    """Feed growing prefixes as the decode thread does; returns the concatenated deltas."""
    out = ""
    for k in range(1, len(ids) + 1):
        out += stream.update(ids[:k], complete=k == len(ids), ended=ended)
        if stream.answer is not None:
            break
    return out


@pytest.mark.parametrize("stops, max_tokens, text, reason", [
    ([], 100, ANSWER, "stop"),
    (["\n"], 100, "Ben starts with 2 stickers.", "stop"),
    (["####"], 100, "Ben starts with 2 stickers.\nThen he has 2 - 2 = 0.\n", "stop"),
    (["2 = "], 100, "Ben starts with 2 stickers.\nThen he has 2 - ", "stop"),
    ([], 5, "Ben starts with 2 stickers", "length"),
])
def test_stream_deltas_add_up_to_the_answer(tok, stops, max_tokens, text, reason):
    ids = tok(ANSWER, add_special_tokens=False)["input_ids"]
    stream = TextStream(tok, max_tokens, stops)
    assert _feed(tok, stream, ids) == stream.answer.text == text
    assert stream.answer.finish_reason == reason
    # the tokens of the answer: the fewest whose text covers it (with a stop string, up to where it begins)
    covered, short = (tok.decode(stream.answer.token_ids[:n]) for n in (None, -1))
    assert covered.startswith(text) and len(short) < len(text)


def test_stream_holds_back_a_possible_stop_string_and_ends_at_its_length(tok):
    ids = tok("a b\n\nc", add_special_tokens=False)["input_ids"]
    stream = TextStream(tok, 100, ["\n\nc"])
    sent = [stream.update(ids[:k]) for k in range(1, len(ids))]
    assert "\n" not in "".join(sent)  # "\n" and "\n\n" might start the stop string: held back
    stream = TextStream(tok, len(ids), [])
    assert stream.update(ids) and stream.answer is None  # exactly max_tokens committed: an end token may follow
    stream.update(ids, complete=True, ended=True)
    assert stream.answer.finish_reason == "stop"


def test_policies_and_max_tokens():
    policies = parse_served_policies("threshold:tau=0.9,confidence:window=8:cache=dual", block=16, window=None,
                                     cache=None)
    assert [(p.label, p.name, p.args, p.decode) for p in policies] == [
        ("threshold:tau=0.9", "threshold", {"tau": 0.9}, {"block": 16}),
        ("confidence:window=8:cache=dual", "confidence", {}, {"window": 8, "cache": "dual"})]
    cfg = ServeConfig("m", policies, max_positions=512, max_tokens=64, default_max_tokens=32)
    assert cfg.policy(None).label == "threshold:tau=0.9" and cfg.policy("confidence").width == 8
    assert cfg.gen_length(policies[0], 20) == (20, 32) and cfg.gen_length(policies[1], 20) == (20, 24)
    assert cfg.gen_length(policies[0], None) == (32, 32)
    for bad, param in (("random", "policy"), ("threshold:tau=0.5", "policy")):
        with pytest.raises(APIError) as err:
            cfg.policy(bad)
        assert err.value.param == param
    with pytest.raises(APIError, match="more than this server allows"):
        cfg.gen_length(policies[0], 65)
    # tokens per step: the steps follow each request's generation length; per_step must divide the width
    per_step = parse_served_policies("confidence:per_step=2", block=16, window=None, cache=None)[0]
    assert per_step.args == {"per_step": 2} and per_step.policy_args(48) == {"steps": 24}
    with pytest.raises(ValueError, match=r"--policy confidence:per_step=3: .*per_step=3 does not divide.*width 16"):
        ServeConfig("m", parse_served_policies("confidence:per_step=3", block=16, window=None, cache=None),
                    max_positions=512)
    with pytest.raises(ValueError, match="--gen-lengths 24 does not suit policy confidence:per_step=16"):
        ServeConfig("m", parse_served_policies("confidence:per_step=16:window=8", block=None, window=8, cache=None),
                    max_positions=512, max_tokens=24, gen_lengths=(16, 24))
    with pytest.raises(ValueError, match="--policy: oracle"):
        parse_served_policies("confidence,oracle", block=16, window=None, cache=None)
    with pytest.raises(ValueError, match="refresh_shift"):
        parse_served_policies("threshold:cache=dual:refresh_shift=2", block=16, window=None, cache=None)


def test_bodies_are_strict():
    ok = parse_body(ChatRequest, b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", '
                                 b'"text": "hi"}]}], "temperature": 1}')
    assert ok.messages[0].text == "hi" and ok.temperature == 1.0
    for raw, param in ((b'{"model": "m", "prompt": "x", "max_tokens": "5"}', "max_tokens"),
                       (b'{"model": "m", "prompt": "x", "max_tokens": 5.0}', "max_tokens"),
                       (b'{"model": "m", "prompt": 7}', "prompt"),
                       (b'{"model": "m", "prompt": "x", "stop": ["a", ""]}', "stop"),
                       (b'{"model": "m", "prompt": "x", "echo": true}', "echo")):
        with pytest.raises(APIError) as err:
            parse_body(CompletionRequest, raw)
        assert err.value.status == 400 and err.value.param == param


def test_prometheus_text():
    m = Metrics(capacity=4)
    m.inc("requests_total", endpoint="chat", outcome="ok")
    m.observe_step(0.004, rows=3)
    m.observe_step(7.0, rows=1)
    m.set_batch(running=2, waiting=1, engines=1)
    text = m.render()
    assert 'tracelock_requests_total{endpoint="chat",outcome="ok"} 1' in text
    assert 'tracelock_step_seconds_bucket{le="0.005"} 1' in text and 'le="+Inf"} 2' in text
    assert "tracelock_row_steps_total 4" in text and "tracelock_batch_occupancy 0.5" in text
    assert all(line.startswith(("# HELP", "# TYPE", "tracelock_")) for line in text.splitlines())


def test_per_step_with_gen_lengths_the_width_does_not_hold():
    """per_step=16 in a window of 8 is fine when every served generation length is a multiple of 16: the start-up
    build uses a generation length the server runs, not the width."""
    from tracelock.cli import build_parser
    from tracelock.serve.cli import build_state

    args = build_parser().parse_args(["serve", "--model", "testbed", "--policy", "confidence:per_step=16",
                                      "--window", "8", "--gen-lengths", "16,32", "--max-tokens", "32", "--port", "0",
                                      "--threads", "1"])
    state = build_state(args)
    assert state.config.policies[0].policy_args(32) == {"steps": 2}


@pytest.mark.parametrize("args, message", [
    (["--policy", "threshold,oracle"], "--policy: oracle replays reference tokens and cannot be served"),
    (["--policy", "threshold:tau=0.9:schedule=full"], "set the schedule with block=N or window=N"),
    (["--policy", "tracelock"], "controller"),
    (["--gen-lengths", "64", "--max-tokens", "128"], "--max-tokens 128 is more than the longest --gen-lengths 64"),
    (["--gen-lengths", "48", "--block", "32", "--max-tokens", "48"], "does not suit policy"),
    (["--max-batch", "0"], "--max-batch 0 must be >= 1"),
])
def test_serve_refuses_bad_options_before_listening(capsys, args, message):
    from tracelock.cli import main

    assert main(["serve", "--model", "testbed", "--port", "0", *args]) == 2
    assert message in capsys.readouterr().err
