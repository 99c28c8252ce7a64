"""QA judge: the paper's batch-ranking and critic protocols against a real OpenAI-style HTTP server on loopback,
strict reply parsing, hand-computed metrics with ties, and a tiny local transformers judge."""

import json
import socket

import pytest
from chat_server import Sleep, ranking_candidates  # tests/chat_server.py, loaded by conftest.py

from tracelock.eval.judge import critic_rate, fractional_ranks, rank_systems, top_two_group
from tracelock.eval.judge_backends import HTTPJudge, JudgeHTTPError, LocalJudge
from tracelock.eval.judge_prompts import (
    CRITIC_SYSTEM,
    RANKING_SYSTEM,
    ReplyError,
    extract_json_object,
    parse_scores,
    parse_verdict,
    ranking_messages,
)

IDS3 = ["candidate_1", "candidate_2", "candidate_3"]


def http_judge(server, **kw):
    kw = {"timeout_s": 5.0, "max_retries": 2, "backoff_s": 0.01, **kw}
    return HTTPJudge(f"http://127.0.0.1:{server.server_port}/v1", "judge-model", **kw)


def scorer(table: dict[str, float], *, fence=False):
    """A script entry that scores each candidate by its answer text, wherever the shuffle put it."""

    def reply(body):
        obj = {"scores": {cid: table[answer] for cid, answer in ranking_candidates(body).items()}, "reason": "ok"}
        text = json.dumps(obj)
        return f"```json\n{text}\n```" if fence else text

    return reply


def scores_reply(*values):
    return json.dumps({"scores": {f"candidate_{i + 1}": v for i, v in enumerate(values)}, "reason": "r"})


def test_rank_systems_over_http_hand_computed(server):
    prompts = ["Name a primary colour.", "What is 2 + 2?"]
    answers = {"random": ["grass", "five"], "confidence": ["red", "4"], "tracelock": ["blue", "four"]}
    # prompt 0: red 9, blue 9, grass 2 -> ranks 1.5 / 1.5 / 3; prompt 1: 4 and four tie second -> 1 / 2.5 / 2.5
    server.script += [scorer({"grass": 2, "red": 9, "blue": 9}),
                      scorer({"five": 1, "4": 7, "four": 7}, fence=True)]
    res = rank_systems(http_judge(server, api_key="sk-test"), prompts, answers, seed=3)
    assert [p.ranks for p in res.prompts] == [{"random": 3.0, "confidence": 1.5, "tracelock": 1.5},
                                              {"random": 3.0, "confidence": 1.5, "tracelock": 1.5}]
    assert res.average_rank() == {"random": 3.0, "confidence": 1.5, "tracelock": 1.5}
    assert res.top_two_rate() == {"random": 0.0, "confidence": 1.0, "tracelock": 1.0}
    assert res.unjudged == [] and res.n_unusable_replies == 0
    assert len(server.requests) == 2 and server.script == []
    for req, question in zip(server.requests, prompts):
        body = req["body"]
        assert req["path"] == "/v1/chat/completions"
        assert req["headers"]["Authorization"] == "Bearer sk-test"
        assert body["model"] == "judge-model" and body["temperature"] == 0
        assert [m["role"] for m in body["messages"]] == ["system", "user"]
        assert body["messages"][0]["content"] == RANKING_SYSTEM
        user = body["messages"][1]["content"]
        assert f"Question:\n{question}\n" in user and "Total candidates: 3\n" in user
        assert "candidate_1, candidate_2, candidate_3" in user
        # anonymised: no system name reaches the judge
        assert not any(name in json.dumps(body) for name in answers)
    assert json.loads(json.dumps(res.to_dict()))["average_rank"]["random"] == 3.0


def test_rank_systems_four_systems_top_two_ties(server):
    answers = {s: [f"{s} says {i}" for i in range(2)] for s in ("a", "b", "c", "d")}
    # prompt 0: 8, 6, 6, 6 -> ranks 1, 3, 3, 3, all four in the top-two group (one strictly better at most)
    # prompt 1: 5, 9, 9, 1 -> ranks 3, 1.5, 1.5, 4, top two b and c
    server.script += [scorer({"a says 0": 8, "b says 0": 6, "c says 0": 6, "d says 0": 6}),
                      scorer({"a says 1": 5, "b says 1": 9, "c says 1": 9, "d says 1": 1})]
    res = rank_systems(http_judge(server), ["q0", "q1"], answers)
    assert res.average_rank() == {"a": 2.0, "b": 2.25, "c": 2.25, "d": 3.5}
    assert res.top_two_rate() == {"a": 0.5, "b": 1.0, "c": 1.0, "d": 0.5}
    # every prompt's fractional ranks sum to n(n+1)/2, ties or not
    assert all(sum(p.ranks.values()) == 10 for p in res.prompts)


def test_candidate_order_is_seeded_and_varies(server):
    systems = {s: [f"{s}-{i}" for i in range(8)] for s in ("w", "x", "y", "z")}
    table = {f"{s}-{i}": 5 for s in systems for i in range(8)}
    server.script += [scorer(table)] * 16
    first = rank_systems(http_judge(server), [f"q{i}" for i in range(8)], systems, seed=7)
    again = rank_systems(http_judge(server), [f"q{i}" for i in range(8)], systems, seed=7)
    assert [p.order for p in first.prompts] == [p.order for p in again.prompts]
    assert len({tuple(p.order) for p in first.prompts}) > 1
    # the order recorded is the order shown: candidate_k carried order[k-1]'s answer
    for p, req in zip(first.prompts, server.requests):
        shown = ranking_candidates(req["body"])
        assert [shown[f"candidate_{k + 1}"] for k in range(4)] == [f"{s}-{p.index}" for s in p.order]


@pytest.mark.parametrize("bad, why", [
    ("{'scores': {'candidate_1': 8, 'candidate_2': 6, 'candidate_3': 1}}", "malformed or truncated"),
    ('{"scores": {"candidate_1": 8, "candidate_2": 6, "candidate_3": 1}', "malformed or truncated"),
    ('{"scores": {"candidate_1": 8, "candidate_2": 6, "candi', "malformed or truncated"),
    ('{"scores": {"A": 1, "B": 2, "C": 3}}', "missing ['candidate_1', 'candidate_2', 'candidate_3']"),
])
def test_unusable_reply_then_reask(server, bad, why):
    server.script += [bad, scores_reply(3, 7, 7)]
    res = rank_systems(http_judge(server), ["q"], {"s1": ["a"], "s2": ["b"], "s3": ["c"]})
    (p,) = res.prompts
    assert p.judged and len(p.unusable) == 1
    assert p.unusable[0].raw == bad and why in p.unusable[0].reason and p.unusable[0].attempt == 0
    assert sorted(p.ranks.values()) == [1.5, 1.5, 3.0]
    # the re-ask shows the judge its reply and what was wrong with it
    msgs = server.requests[1]["body"]["messages"]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert msgs[2]["content"] == bad and why in msgs[3]["content"]
    assert msgs[:2] == server.requests[0]["body"]["messages"]


def test_persistent_garbage_is_unjudged_never_scored(server):
    garbage = ["I think candidate 2 is best.", "```json\n{\"scores\": \n```", "{}"]
    server.script += [*garbage, scores_reply(9, 1)]
    res = rank_systems(http_judge(server), ["q0", "q1"], {"p": ["x", "y"], "q": ["z", "w"]}, retries=2)
    assert res.unjudged == [0] and [p.judged for p in res.prompts] == [False, True]
    assert [u.raw for u in res.prompts[0].unusable] == garbage
    assert [u.attempt for u in res.prompts[0].unusable] == [0, 1, 2]
    assert res.prompts[0].ranks == {} and res.n_unusable_replies == 3
    # the averages are over the one judged prompt only
    assert sorted(res.average_rank().values()) == [1.0, 2.0]
    d = json.loads(json.dumps(res.to_dict()))
    assert d["n_unjudged"] == 1 and d["n_judged"] == 1 and d["prompts"][0]["unusable"][0]["raw"] == garbage[0]


def test_all_unjudged_gives_none(server):
    server.script += ["no"] * 2
    res = rank_systems(http_judge(server), ["q"], {"a": ["x"], "b": ["y"]}, retries=1)
    assert res.average_rank() == {"a": None, "b": None} and res.top_two_rate() == {"a": None, "b": None}


def test_http_retries_500_and_429_then_succeeds(server):
    server.script += [(500, '{"error": "overloaded"}'), (429, '{"error": "slow down"}', {"Retry-After": "0"}),
                      "hello"]
    assert http_judge(server).complete([{"role": "user", "content": "hi"}]) == "hello"
    assert len(server.requests) == 3
    assert all(r["body"] == server.requests[0]["body"] for r in server.requests)


def test_http_persistent_500_raises_after_retries(server):
    server.script += [(503, "down")] * 3
    with pytest.raises(JudgeHTTPError, match="failed 3 times; last error HTTP 503"):
        http_judge(server, max_retries=2).complete([{"role": "user", "content": "hi"}])
    assert len(server.requests) == 3


def test_http_timeout_is_retried(server):
    # the wall clock is the behaviour: the late reply waits 5x the 0.3 s timeout (a sleep, so never sooner), and the
    # retried one, a loopback reply of a few milliseconds, has 0.3 s, 100x that, however busy the machine
    server.script += [Sleep(1.5, "late"), "on time"]
    judge = http_judge(server, timeout_s=0.3)
    assert judge.complete([{"role": "user", "content": "hi"}]) == "on time"


@pytest.mark.parametrize("status", [400, 401, 404])
def test_http_client_errors_are_not_retried(server, status):
    server.script += [(status, '{"error": "nope"}')]
    with pytest.raises(JudgeHTTPError, match=f"HTTP {status}.*API key"):
        http_judge(server).complete([{"role": "user", "content": "hi"}])
    assert len(server.requests) == 1


def test_http_wrong_base_url_is_a_clear_error(server):
    judge = HTTPJudge(f"http://127.0.0.1:{server.server_port}", "m", backoff_s=0.01)
    with pytest.raises(JudgeHTTPError, match="HTTP 404.*/v1"):
        judge.complete([{"role": "user", "content": "hi"}])
    assert server.requests[0]["path"] == "/chat/completions"


def test_http_not_a_chat_completion(server):
    server.script += [(200, '{"choices": []}'), (200, "<html>proxy</html>")]
    judge = http_judge(server)
    for _ in range(2):
        with pytest.raises(JudgeHTTPError, match="did not answer with a chat completion"):
            judge.complete([{"role": "user", "content": "hi"}])


def test_http_connection_refused():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    judge = HTTPJudge(f"http://127.0.0.1:{port}/v1", "m", max_retries=1, backoff_s=0.01)
    with pytest.raises(JudgeHTTPError, match="failed 2 times.*reachable"):
        judge.complete([{"role": "user", "content": "hi"}])


def test_http_judge_argument_errors():
    with pytest.raises(ValueError, match="base_url must start with http"):
        HTTPJudge("127.0.0.1:8000/v1", "m")
    with pytest.raises(ValueError, match="model must be"):
        HTTPJudge("http://x/v1", "")
    with pytest.raises(TypeError, match=r"messages\[0\]"):
        HTTPJudge("http://x/v1", "m").complete([{"role": "user"}])


def test_critic_rate_over_http(server):
    verdict = lambda v: json.dumps({"verdict": v, "reason": "because"})  # noqa: E731
    server.script += [verdict("correct"), verdict("incorrect"), verdict("not_judgeable"),
                      '{"verdict": "maybe"}', "```json\n" + verdict("correct") + "\n```",
                      "garbage", '{"verdict": "correct", "verdict": "incorrect"}']
    prompts = ["q0", "q1", "q2", "q3", "q4"]
    res = critic_rate(http_judge(server), prompts, ["a0", "a1", "a2", "a3", "a4"], ["r0", "r1", "r2", "r3", "r4"],
                      retries=1)
    assert [item.verdict for item in res.items] == ["correct", "incorrect", "not_judgeable", "correct", None]
    # 2 correct of 3 judgeable: not_judgeable and unjudged items are outside the denominator
    assert res.rate == pytest.approx(2 / 3)
    d = json.loads(json.dumps(res.to_dict()))
    assert (d["n_correct"], d["n_incorrect"], d["n_not_judgeable"], d["n_unjudged"]) == (2, 1, 1, 1)
    assert d["unjudged"] == [4] and d["n_unusable_replies"] == 3
    assert "duplicate keys ['verdict']" in res.items[4].unusable[1].reason
    first = server.requests[0]["body"]
    assert first["messages"][0]["content"] == CRITIC_SYSTEM and first["temperature"] == 0
    assert "Reference answer:\nr0\n" in first["messages"][1]["content"]
    assert first["messages"][1]["content"].endswith("Candidate answer:\na0")


@pytest.mark.parametrize("text", [
    scores_reply(8.4, 6.1, 6.1),
    "Here are the scores:\n" + scores_reply(8.4, 6.1, 6.1) + "\nThanks!",
    "```json\n" + scores_reply(8.4, 6.1, 6.1) + "\n```",
    '{"scores": {"candidate_3": 6.1, "candidate_1": 8.4, "candidate_2": 6.1}}',
    '{"scores": {"candidate_1": 8.4, "candidate_2": 6.1, "candidate_3": 6.1}, "reason": "has {braces} inside"}',
])
def test_parse_scores_accepts(text):
    assert parse_scores(text, IDS3)[0] == {"candidate_1": 8.4, "candidate_2": 6.1, "candidate_3": 6.1}


@pytest.mark.parametrize("text, why", [
    ("", "no JSON object"),
    ("8.4, 6.1, 6.1", "no JSON object"),
    (scores_reply(1, 2, 3) + scores_reply(1, 2, 3), "2 JSON objects"),
    ("{oops} " + scores_reply(1, 2, 3), "malformed"),
    ('{"scores": {"candidate_1": NaN, "candidate_2": 1, "candidate_3": 1}}', "NaN is not a valid JSON number"),
    ('{"scores": {"candidate_1": 1, "candidate_1": 2, "candidate_2": 1, "candidate_3": 1}}', "duplicate keys"),
    ('{"scores": {"candidate_1": true, "candidate_2": 1, "candidate_3": 1}}', "true, not a number"),
    ('{"scores": {"candidate_1": "8", "candidate_2": 1, "candidate_3": 1}}', '"8", not a number'),
    ('{"scores": {"candidate_1": 11, "candidate_2": 1, "candidate_3": 1}}', "outside the 0 to 10 scale"),
    ('{"scores": {"candidate_1": -1, "candidate_2": 1, "candidate_3": 1}}', "outside the 0 to 10 scale"),
    ('{"scores": {"candidate_1": 1, "candidate_2": 1}}', "missing ['candidate_3']"),
    ('{"scores": {"candidate_1": 1, "candidate_2": 1, "candidate_3": 1, "candidate_4": 1}}', "unexpected ['cand"),
    ('{"scores": [8, 6, 6]}', "'scores' must be a JSON object"),
    ('{"ranks": {"candidate_1": 1}}', "no 'scores' field"),
    ('{"scores": {"candidate_1": 1, "candidate_2": 1, "candidate_3": 1}, "best": 1}', "unexpected fields ['best']"),
    ('{"scores": {"candidate_1": 1, "candidate_2": 1, "candidate_3": 1}, "reason": 3}', "'reason' must be a string"),
])
def test_parse_scores_rejects(text, why):
    with pytest.raises(ReplyError) as e:
        parse_scores(text, IDS3)
    assert why in str(e.value)


def test_parse_verdict_and_extract():
    assert parse_verdict('ok: {"verdict": "not_judgeable", "reason": "open-ended"}') == ("not_judgeable",
                                                                                          "open-ended")
    with pytest.raises(ReplyError, match="expected one of"):
        parse_verdict('{"verdict": ["correct"]}')
    with pytest.raises(ReplyError, match="not text"):
        extract_json_object(None)


def test_fractional_ranks_and_top_two_by_hand():
    assert fractional_ranks({"a": 9, "b": 9, "c": 5, "d": 2}) == {"a": 1.5, "b": 1.5, "c": 3, "d": 4}
    assert fractional_ranks({"a": 1, "b": 1, "c": 1}) == {"a": 2, "b": 2, "c": 2}
    assert fractional_ranks({"a": 3, "b": 7, "c": 7, "d": 7, "e": 0}) == {"a": 4, "b": 2, "c": 2, "d": 2, "e": 5}
    assert top_two_group({"a": 9, "b": 9, "c": 5, "d": 2}) == {"a": True, "b": True, "c": False, "d": False}
    assert top_two_group({"a": 8, "b": 6, "c": 6, "d": 6}) == {"a": True, "b": True, "c": True, "d": True}
    assert top_two_group({"a": 3, "b": 7, "c": 7, "d": 7}) == {"a": False, "b": True, "c": True, "d": True}


def test_prompt_text_is_substituted_once():
    msgs = ranking_messages("Explain {candidate_answers} and {question}", ["uses {num_candidates}", "b"])
    user = msgs[1]["content"]
    assert "Question:\nExplain {candidate_answers} and {question}\n" in user
    assert "[candidate_1]\nuses {num_candidates}\n\n[candidate_2]\nb" in user


def test_input_errors():
    judge = HTTPJudge("http://127.0.0.1:9/v1", "m")  # never called: the arguments fail first
    with pytest.raises(ValueError, match="at least two systems"):
        rank_systems(judge, ["q"], {"only": ["a"]})
    with pytest.raises(ValueError, match="has 1 items but there are 2 prompts"):
        rank_systems(judge, ["q", "r"], {"a": ["x"], "b": ["y", "z"]})
    with pytest.raises(TypeError, match="strings only; items \\[1\\]"):
        rank_systems(judge, ["q", "r"], {"a": ["x", 3], "b": ["y", "z"]})
    with pytest.raises(TypeError, match="must be a list of strings"):
        rank_systems(judge, "q", {"a": ["x"], "b": ["y"]})
    with pytest.raises(ValueError, match="retries must be an int >= 0"):
        rank_systems(judge, ["q"], {"a": ["x"], "b": ["y"]}, retries=-1)
    with pytest.raises(ValueError, match="references \\[0\\] are empty"):
        critic_rate(judge, ["q"], ["a"], [" "])


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A 2-layer random LlamaForCausalLM with the toy LLaDA tokenizer (Llama-3 chat template)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tracelock.models.tiny_tokenizer import tiny_vocab, write_tokenizer_files

    folder = tmp_path_factory.mktemp("tiny_llama")
    ids = write_tokenizer_files(folder, "llada", model_max_length=4096)
    config = LlamaConfig(vocab_size=len(tiny_vocab("llada")), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096, bos_token_id=ids["bos_token"], eos_token_id=ids["eos_token"],
                         pad_token_id=ids["pad_token"])
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def test_local_judge_garbage_is_recorded_not_scored(tiny_llama):
    judge = LocalJudge(tiny_llama, max_new_tokens=12)
    msgs = [{"role": "user", "content": "What is two plus two ?"}]
    reply = judge.complete(msgs)
    assert isinstance(reply, str) and reply == judge.complete(msgs)
    res = rank_systems(judge, ["What is two plus two ?"], {"a": ["four"], "b": ["five"]}, retries=1)
    assert res.unjudged == [0] and len(res.prompts[0].unusable) == 2
    assert all(u.reason and isinstance(u.raw, str) for u in res.prompts[0].unusable)
    crit = critic_rate(judge, ["q"], ["a"], ["r"], retries=0)
    assert crit.rate is None and crit.to_dict()["n_unjudged"] == 1


def test_local_judge_needs_a_chat_template(tiny_llama, tmp_path):
    for f in tiny_llama.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no chat template"):
        LocalJudge(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a folder"):
        LocalJudge(tmp_path / "missing")
