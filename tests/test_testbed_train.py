"""The testbed pipeline on a micro model: training a few steps, exact resume, evaluation, demo."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import tracelock
from tracelock.models import loading
from tracelock.models.spec import CheckpointError
from tracelock.testbed import held_out
from tracelock.testbed.evaluate import evaluate_policies, format_table
from tracelock.testbed.model_files import NUMBER_TOKENS, train_tokenizer
from tracelock.testbed.train import BackboneTrainConfig, Batches, block_mask, sft_loss, state_file, train_backbone


def micro_config(out, **kw):
    return BackboneTrainConfig(out=str(out), steps=4, batch_size=4, d_model=32, n_layers=4, n_heads=2, mlp=64,
                       vocab_size=400, tokenizer_corpus=300, save_every=2, **kw)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("testbed") / "run"
    train_backbone(micro_config(out), progress=False)
    return out


def test_trained_folder_loads_and_round_trips_code(trained):
    model = tracelock.load_model(trained)
    tok = tracelock.load_tokenizer(trained)
    assert model.spec.family == "llada" and model.spec.num_layers == 4
    state = load_file(str(trained / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in state.values())
    code = held_out("code", "test", 3)
    for ex in code:
        ids = tok(ex.answer, add_special_tokens=False)["input_ids"]
        # byte-level BPE keeps indentation and newlines exactly: generated Python stays valid
        assert tok.decode(ids) == ex.answer
    # a token never mixes digits with letters
    math = held_out("math", "test", 3)
    for ex in math:
        pieces = [tok.decode([i]).strip() for i in tok(ex.answer, add_special_tokens=False)["input_ids"]]
        assert all(p.isdigit() for p in pieces if any(c.isdigit() for c in p))
    log = json.loads((trained / "train_state.json").read_text())
    assert log["step"] == 4 and len(log["loss"]) == 0


def test_shipped_tokenizer_settings_make_every_task_number_one_token():
    tok = train_tokenizer(("math", "code"), vocab_size=1024, corpus_size=300, seed=0)
    for n in range(NUMBER_TOKENS):
        assert len(tok.encode(f"{n}").ids) == 1 and len(tok.encode(f" {n}").ids) == 1, n


def test_resume_after_interruption_gives_the_same_weights(trained, tmp_path):
    out = tmp_path / "run"
    train_backbone(micro_config(out), progress=False, stop_after=2)
    assert not (out / "model.safetensors").exists()
    assert json.loads((out / "train_state.json").read_text())["step"] == 2
    with pytest.raises(FileExistsError, match="--resume"):
        train_backbone(micro_config(out), resume=False, progress=False)
    with pytest.raises(ValueError, match="another configuration"):
        train_backbone(micro_config(out, lr=5e-4), progress=False)
    # a state saved before a setting existed (here block_fraction) resumes while that setting is at its default
    log = json.loads((out / "train_state.json").read_text())
    del log["config"]["block_fraction"], log["config"]["block_sizes"]
    (out / "train_state.json").write_text(json.dumps(log))
    with pytest.raises(ValueError, match="another configuration"):
        train_backbone(micro_config(out, block_fraction=0.5), progress=False)
    train_backbone(micro_config(out), progress=False)
    a, b = load_file(str(trained / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_ar_warmup_switches_objective_and_resumes_across_the_switch(trained, tmp_path):
    from tracelock.testbed.train import _lr

    # each phase gets its own warm-up and cosine decay: the schedule restarts at the switch
    cfg = micro_config(tmp_path / "lr", ar_steps=2, warmup=2)
    assert _lr(cfg, 0) == _lr(cfg, 2) == cfg.lr / 2 and _lr(cfg, 1) == _lr(cfg, 3) == cfg.lr
    # the masked phase may peak lower (masked_lr); the AR phase keeps lr
    low = micro_config(tmp_path / "lr", ar_steps=2, warmup=2, masked_lr=1e-4)
    assert _lr(low, 1) == low.lr and _lr(low, 3) == 1e-4
    train_backbone(micro_config(tmp_path / "a", ar_steps=2, warmup=1), progress=False)
    out = tmp_path / "b"
    train_backbone(micro_config(out, ar_steps=2, warmup=1), progress=False, stop_after=2)  # saved at the switch
    with pytest.raises(ValueError, match="another configuration"):
        train_backbone(micro_config(out, ar_steps=1, warmup=1), progress=False)
    train_backbone(micro_config(out, ar_steps=2, warmup=1), progress=False)
    a, b = load_file(str(tmp_path / "a" / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the first phase is not LLaDA's objective: the weights differ from a masked-only run with the same schedule
    c = tmp_path / "c"
    train_backbone(micro_config(c, warmup=1), progress=False)
    other = load_file(str(c / "model.safetensors"))
    assert any(not torch.equal(a[k], other[k]) for k in a)
    with pytest.raises(ValueError, match="--ar-steps smaller than --steps"):
        train_backbone(micro_config(tmp_path / "d", ar_steps=4), progress=False)


def test_probes_record_validation_accuracy_and_leave_the_weights_alone(trained, tmp_path):
    from tracelock.models.backbone import DiffusionBackbone
    from tracelock.models.spec import ModelSpec
    from tracelock.testbed.train import probe

    out = tmp_path / "run"
    train_backbone(micro_config(out, probe_every=2, probe_items=3), progress=False)
    a, b = load_file(str(trained / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    log = json.loads((out / "train_state.json").read_text())
    assert sorted(log["probes"]) == ["2", "4"] and all(sorted(p) == ["code", "math"] for p in log["probes"].values())
    # the recorded numbers are the probe of the saved (final, fp32) state
    model = DiffusionBackbone(ModelSpec.from_pretrained(out))
    state = load_file(str(state_file(out)))
    model.load_state_dict({k[len("model/"):]: v for k, v in state.items() if k.startswith("model/")})
    assert probe(model, tracelock.load_tokenizer(out), ("math", "code"), 3) == log["probes"]["4"]


def test_compiled_steps_resume_an_eager_run_and_match_it(trained, tmp_path):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # counters outlive reset(): count this test's graphs only
    out = tmp_path / "run"
    train_backbone(micro_config(out), progress=False, stop_after=2)
    train_backbone(micro_config(out, compile=True), progress=False)  # --compile may be switched on at resume
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # the loss really went through compile
    a, b = load_file(str(trained / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.allclose(a[k].float(), b[k].float(), atol=1e-3) for k in a)
    # the compiled loss is the eager one up to float reordering: same value, same gradients
    model = tracelock.load_model(out, dtype=torch.float32).requires_grad_(True)  # loaded frozen
    x, region, answer_len = Batches(micro_config(out), tracelock.load_tokenizer(out), model.spec)(7)
    results = []
    for fn in (sft_loss, torch.compile(sft_loss, dynamic=True)):
        model.zero_grad()
        loss = fn(model, x, region, torch.Generator().manual_seed(3), 1e-3, answer_len)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (eager_loss, eager_grads), (compiled_loss, compiled_grads) = results
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-5, atol=1e-6)
    for e, c in zip(eager_grads, compiled_grads):
        torch.testing.assert_close(c, e, rtol=1e-3, atol=1e-6)


def test_compiled_training_is_deterministic_and_leaves_the_mode_as_it_was(tmp_path):
    # inductor adds the embedding gradient with atomic adds from several threads; without deterministic
    # algorithms two compiled runs from one seed differed in their last bits and drifted apart
    runs = [tmp_path / "a", tmp_path / "b"]
    threads = torch.get_num_threads()
    try:
        for out in runs:
            train_backbone(micro_config(out, compile=True, threads=2, ar_steps=1), progress=False)
    finally:
        torch.set_num_threads(threads)
    assert not torch.are_deterministic_algorithms_enabled()
    assert _same_states(*runs)


def _same_states(a, b):
    a, b = (load_file(str(state_file(out))) for out in (a, b))
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_batches_built_by_worker_processes_train_the_same_weights(trained, tmp_path):
    # the DataLoader returns whole batches in step order, so the run is the in-process one; a resume may change it
    out = tmp_path / "run"
    train_backbone(micro_config(out, workers=2), progress=False, stop_after=2)
    train_backbone(micro_config(out, workers=1), progress=False)
    assert _same_states(trained, out)


@pytest.mark.parametrize("device,match", [("tpu", "--device cpu or --device cuda"), ("cpu:x", "not a torch device")])
def test_bad_device_is_refused_with_the_fix(tmp_path, device, match):
    with pytest.raises(ValueError, match=match):
        train_backbone(micro_config(tmp_path / "run", device=device), progress=False)
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_cuda_device_without_a_gpu_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no CUDA device"):
        train_backbone(micro_config(tmp_path / "run", device="cuda"), progress=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_training_is_deterministic_resumes_and_matches_the_cpu_run(trained, tmp_path):
    # the masks are drawn on the CPU, so a CUDA run sees the CPU run's data and masks: it differs by rounding only
    a, b = tmp_path / "a", tmp_path / "b"
    train_backbone(micro_config(a, device="cuda", ar_steps=1, workers=2), progress=False)
    train_backbone(micro_config(b, device="cuda", ar_steps=1), progress=False, stop_after=2)
    train_backbone(micro_config(b, device="cuda", ar_steps=1), progress=False)
    assert _same_states(a, b)
    cpu = tmp_path / "cpu"
    train_backbone(micro_config(cpu, ar_steps=1), progress=False)
    x, y = (load_file(str(out / "model.safetensors")) for out in (a, cpu))
    assert all(torch.allclose(x[k].float(), y[k].float(), atol=1e-2) for k in x)


def test_evaluation_scores_math_and_sandboxed_code(trained):
    model, tok = tracelock.load_model(trained), tracelock.load_tokenizer(trained)
    for task in ("math", "code"):
        items = held_out(task, "test", 3)
        rows = evaluate_policies(model, tok, items, gen_length=16, block=8,
                                 policies=[("confidence 1/step", "confidence", {}), ("threshold 0.9", "threshold",
                                                                                      {"tau": 0.9})])
        assert [r.label for r in rows] == ["confidence 1/step", "threshold 0.9", "oracle (of confidence 1/step)"]
        assert rows[0].avg_steps == 16 and rows[1].avg_steps <= 16
        # the oracle commits at least everything the reference got right in one step: never more steps
        assert rows[2].avg_steps <= rows[0].avg_steps
        assert all(len(r.correct) == 3 for r in rows)
        assert "| confidence 1/step |" in format_table(task, "gen 16, block 8", [r.summary() for r in rows])
    # the reference answers themselves pass: the scorer is not trivially false
    from tracelock.testbed.evaluate import score_items

    for task in ("math", "code"):
        items = held_out(task, "test", 4)
        assert score_items(items, [ex.answer for ex in items]) == [True] * 4
        assert score_items(items, ["#### -1" if task == "math" else "    return None\n"] * 4) == [False] * 4


def test_demo_cli(trained):
    proc = subprocess.run([sys.executable, "-m", "tracelock", "demo", "--model", str(trained), "--limit", "2",
                           "--gen-length", "16", "--block", "8"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "math, gen 16, block 8, 2 held-out items" in proc.stdout
    assert "| random 1/step |" in proc.stdout and "| oracle (of confidence 1/step) |" in proc.stdout
    # progress: one bar per task on stderr, items of every row (5 baselines and the oracle, 2 items each)
    assert "math: 100%" in proc.stderr and "12/12" in proc.stderr and "%|" not in proc.stdout


def test_demo_method_trains_a_controller_and_the_demo_uses_it(trained, tmp_path):
    from tracelock.testbed.demo_method import DemoMethodConfig, train_demo_controller

    config = DemoMethodConfig(num=3, gen_length=16, block=8, fraction=0.5, max_positions=256, steps=2,
                              batch_size=4, filters=False)
    said = []
    run = train_demo_controller(trained, tmp_path / "work", config, say=said.append)
    assert said[0].startswith("collect") and said[-1].startswith("train")
    assert (run / "best.safetensors").is_file() and (run / "encoder.json").is_file()
    summary = json.loads((tmp_path / "work" / "demo_method.json").read_text())
    assert summary["collect"]["kept"] == 6 and summary["config"]["steps"] == 2
    # a finished pipeline is reused, not run again
    said.clear()
    assert train_demo_controller(trained, tmp_path / "work", config, say=said.append) == run
    assert said == [f"reusing the controller in {run}"]
    proc = subprocess.run([sys.executable, "-m", "tracelock", "demo", "--model", str(trained), "--limit", "2",
                           "--tasks", "math", "--gen-length", "16", "--block", "8", "--controller", str(run)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "| TraceLock (window 8) |" in proc.stdout and "| oracle (of confidence 1/step) |" in proc.stdout


def test_demo_method_refuses_when_every_trace_is_filtered(trained, tmp_path):
    from tracelock.testbed.demo_method import DemoMethodConfig, train_demo_controller

    # the micro model writes degenerate text, which the default filters drop
    config = DemoMethodConfig(num=2, tasks="math", gen_length=16, block=8, steps=1, batch_size=2)
    with pytest.raises(RuntimeError, match="filtered out"):
        train_demo_controller(trained, tmp_path / "work", config)


def test_eval_cli_resumes_per_policy_row(trained, tmp_path):
    out = tmp_path / "eval.json"
    cmd = [sys.executable, "-m", "tracelock", "testbed-eval", "--model", str(trained), "--tasks", "math", "--limit",
           "2", "--settings", "16/8", "--out", str(out)]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    results = json.loads(out.read_text())
    assert list(results) == ["math gen16 block8"]
    rows = results["math gen16 block8"]
    assert len(rows) == 8 and rows[0]["policy"] == "confidence 1/step"
    assert rows[-1]["policy"] == "oracle (of confidence 1/step)"
    # drop the last policy row and the oracle, as if the run had died there: only those two run again
    out.write_text(json.dumps({"math gen16 block8": rows[:-2]}))
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    ran = [line.split(": ", 1)[1] for line in second.stderr.splitlines() if line.startswith("  math gen16 block8: ")]
    assert ran == [rows[-2]["policy"], "oracle"]
    again = json.loads(out.read_text())["math gen16 block8"]
    assert [r["accuracy"] for r in again] == [r["accuracy"] for r in rows]
    assert [r["avg_steps"] for r in again] == [r["avg_steps"] for r in rows]
    # a finished setting is not measured again
    third = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert third.returncode == 0 and "math gen16 block8: " not in third.stderr
    # another item count never mixes into the same rows
    other = subprocess.run(cmd[:-5] + ["3"] + cmd[-4:], capture_output=True, text=True, timeout=300)
    assert other.returncode != 0 and "measured on 2 items; pass --limit 2" in other.stderr


def test_eval_cli_runs_the_chosen_rows_and_refuses_unknown_ones(trained, tmp_path):
    cmd = [sys.executable, "-m", "tracelock", "testbed-eval", "--model", str(trained), "--tasks", "testbed:math",
           "--limit", "2", "--settings", "16/8", "--out", str(tmp_path / "eval.json"), "--policies"]
    # policy specs pick the table's rows (under their labels) and add rows of their own
    chosen = subprocess.run(cmd + ["threshold:tau=0.9,random,threshold:tau=0.8"], capture_output=True, text=True,
                            timeout=300)
    assert chosen.returncode == 0, chosen.stderr
    rows = json.loads((tmp_path / "eval.json").read_text())["math gen16 block8"]
    # the reference row always runs: the oracle replays it
    assert [r["policy"] for r in rows] == ["confidence 1/step", "threshold 0.9", "random 1/step",
                                           "threshold:tau=0.8", "oracle (of confidence 1/step)"]
    # the rows' labels still work for a release, with a deprecation message naming the spec
    old = subprocess.run(cmd + ["threshold 0.9"], capture_output=True, text=True, timeout=300)
    assert old.returncode == 0, old.stderr
    assert "'threshold 0.9' is deprecated, use --policies threshold:tau=0.9" in old.stderr
    unknown = subprocess.run(cmd + ["threshold 0.95"], capture_output=True, text=True, timeout=300)
    assert unknown.returncode == 2 and "'threshold 0.95' is not a policy" in unknown.stderr
    assert "'threshold 0.9'" in unknown.stderr and "Traceback" not in unknown.stderr


def test_bundled_name_resolves(trained, monkeypatch, tmp_path):
    monkeypatch.setattr(loading, "BUNDLED", {"testbed": tmp_path / "missing"})
    with pytest.raises(CheckpointError, match="testbed-train"):
        tracelock.load_model("testbed")
    monkeypatch.setattr(loading, "BUNDLED", {"testbed": Path(trained)})
    assert tracelock.load_model("testbed").spec.num_layers == 4


def test_block_mask_matches_the_states_semi_ar_decoding_visits():
    B, L, start = 64, 80, 12
    region = torch.zeros(B, L, dtype=torch.bool)
    region[:, start:] = True
    answer_len = torch.randint(5, 40, (B,), generator=torch.Generator().manual_seed(1))
    t = torch.rand(B, generator=torch.Generator().manual_seed(2))
    masked, supervised, block = block_mask(region, answer_len, t, (16, 32), torch.Generator().manual_seed(3))
    for i in range(B):
        pos = block[i].nonzero().flatten()
        lo, hi = int(pos[0]), int(pos[-1]) + 1
        assert hi - lo in (16, 32) or hi == L  # a whole block, unless the region ends first
        assert start <= lo < start + int(answer_len[i])  # the block starts inside the answer
        assert not masked[i, :lo].any()  # the answer before the block is clean, as after decoding it
        assert masked[i, hi:].all()  # everything after the block is still masked
        assert torch.equal(supervised[i], masked[i] & block[i])  # loss only on the block's masked positions
    assert 0.3 < supervised[block].float().mean() < 0.7  # ratio t ~ U(0, 1): about half masked on average


def test_sft_loss_with_block_rows_is_finite_and_trains_every_row(trained):
    model = tracelock.load_model(trained, dtype=torch.float32).requires_grad_(True)
    tok = tracelock.load_tokenizer(trained)
    from tracelock.testbed.train import Batches
    cfg = micro_config(trained)
    x, region, answer_len = Batches(cfg, tok, model.spec)(0)
    loss = sft_loss(model, x, region, torch.Generator().manual_seed(0), 1e-3, answer_len, 1.0, (8,))
    assert torch.isfinite(loss) and loss > 0
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_probe_classes_tokens_and_counts_every_answer_token(trained, tmp_path):
    from tracelock.testbed.probe import (
        compute_case_share,
        left_context_result_accuracy,
        object_embedding_cosine,
        single_mask_accuracy,
        token_classes,
    )

    pieces = ["Tom", "has", "4", "+", "9", "=", "13", "stamps", ".", "####", "13"]
    assert token_classes(pieces) == ["name", "other", "operand", "other", "operand", "other", "result", "object",
                                     "other", "other", "operand"]
    model, tok = tracelock.load_model(trained), tracelock.load_tokenizer(trained)
    items = held_out("math", "test", 2)
    counts = single_mask_accuracy(model, tok, items)
    assert sum(n for _, n in counts.values()) == sum(len(tok(ex.answer, add_special_tokens=False)["input_ids"])
                                                     for ex in items)
    assert all(0 <= k <= n for k, n in counts.values()) and counts["object"][1] > 0
    # the micro tokenizer splits " 13" into " " and "13", so its answers have no result class; the bundled model's has
    bundled, bundled_tok = tracelock.load_model("testbed"), tracelock.load_tokenizer("testbed")
    k, n = left_context_result_accuracy(bundled, bundled_tok, items)
    assert n == single_mask_accuracy(bundled, bundled_tok, items)["result"][1] > 0 and 0 <= k <= n
    # LLaDA's masks rarely ask for the arithmetic (a few percent of results); block rows a little more often
    shares = [compute_case_share(bundled_tok, bundled.spec, f, steps=4) for f in (0.0, 1.0)]
    assert 0 < shares[0] < shares[1] < 0.2
    cos = object_embedding_cosine(model, tok)
    assert set(cos) == {"embedding", "lm_head"} and all(-1 <= v <= 1 for v in cos.values())
    out = tmp_path / "probe.json"
    proc = subprocess.run([sys.executable, "-m", "tracelock", "testbed-probe", "--model", str(trained), "--limit", "2",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    saved = json.loads(out.read_text())
    # the progress bar went to stderr: stdout is the JSON alone
    assert json.loads(proc.stdout) == saved and "single-mask probe" in proc.stderr
    assert saved["tokens"] == {c: n for c, (_, n) in counts.items()} and saved["results"] == counts["result"][1]


def test_ship_copies_a_finished_run_with_its_provenance(tmp_path):
    from tracelock.testbed.ship import MODEL_FILES, sha256

    run = tmp_path / "run"
    cfg = dataclasses.replace(micro_config(run, ar_steps=12, probe_every=30, probe_items=2), steps=30, save_every=10)
    train_backbone(cfg, progress=False, stop_after=20)
    cmd = [sys.executable, "-m", "tracelock", "testbed-ship", str(run), "--dest", str(tmp_path / "model"),
           "--command", "tracelock testbed-train ...", "--machine", "this CPU"]
    unfinished = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert unfinished.returncode == 2 and "stopped at step 20 of 30" in unfinished.stderr
    assert "--resume" in unfinished.stderr and not (tmp_path / "model").exists()
    train_backbone(cfg, progress=False)
    shipped = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert shipped.returncode == 0, shipped.stderr
    dest = tmp_path / "model"
    assert all((dest / name).read_bytes() == (run / name).read_bytes() for name in MODEL_FILES)
    info = json.loads((dest / "testbed.json").read_text())
    assert info["model_safetensors_sha256"] == sha256(run / "model.safetensors")
    assert info["command"] == "tracelock testbed-train ..." and info["machine"] == "this CPU"
    assert info["steps"] == 30 and info["config"]["ar_steps"] == 12 and info["train_seconds"] > 0
    # each phase's curve holds only its own steps: the AR loss (10-step means up to step 12) and the masked loss
    log = json.loads((run / "train_state.json").read_text())
    assert info["loss_curve_ar"] == [p for p in log["loss"] if p[0] <= 12] == [[10, log["loss"][0][1]]]
    assert info["loss_curve_masked"] == [p for p in log["loss"] if p[0] > 12]
    assert info["final_loss_10_step_mean"] == log["loss"][-1][1]
    assert set(info["probes"]) == {"how", "30"}
    # a folder that holds a model (the bundled one included) is replaced only when asked
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "already holds a model; pass --overwrite" in again.stderr
    assert subprocess.run(cmd + ["--overwrite"], capture_output=True, text=True, timeout=120).returncode == 0
    bundled = subprocess.run(cmd[:5] + cmd[7:], capture_output=True, text=True, timeout=120)
    assert bundled.returncode == 2 and "--dest" in bundled.stderr and "required" in bundled.stderr
    assert tracelock.load_model(dest).spec.num_layers == 4


@pytest.mark.parametrize("field, value, match", [
    ("tokenizer_corpus", 0, "tokenizer_corpus=0: the tokenizer trains on 1 to 1000000 task texts"),
    ("tokenizer_corpus", 10**20, "pass --tokenizer-corpus in that range"),
    ("vocab_size", 1 << 20, "a smaller --vocab-size"),
    ("d_model", 10**8, "d_model=100000000, .* parameters; .* pass smaller --d-model"),
    ("mlp", 10**9, "mlp=1000000000 make about .* pass smaller"),
    ("n_layers", 0, "n_layers=0 must be a positive integer; pass --n-layers >= 1"),
    ("n_heads", 3, "d_model=256 is not divisible by n_heads=3"),
    ("batch_size", 10**9, "pass --batch-size at most 65536"),
])
def test_sizes_that_would_hang_or_abort_the_process_are_refused_first(tmp_path, field, value, match):
    """A huge tokenizer corpus ran in library code past any time limit, a huge vocabulary aborted the process, a huge
    model reached torch's allocator as a raw RuntimeError: all are refused before the run folder exists."""
    with pytest.raises(ValueError, match=match):
        train_backbone(BackboneTrainConfig(out=str(tmp_path / "run"), **{field: value}), progress=False)
    assert not (tmp_path / "run").exists()
