"""Quantized weights through torchao (`tracelock.models.quantize`, ``--quantize``): a format the device, the dtype or
the installed torchao cannot run is refused before any weight is read, naming the format, the device and what would
run it; a missing torchao names the ``quant`` extra; int8 on the CPU quantizes every block linear and nothing else,
keeps the checkpoint's fingerprint (the shipped controllers load), decodes the same tokens in the fused and reference
loops and through dynamo, and `tracelock serve --quantize int8` answers as the offline path does.

The tests that quantize need torchao (the quant extra, part of the test extra): without it they skip, saying so; the
refusals run either way."""

import sys

import pytest
import torch

import tracelock
from tracelock import cli
from tracelock.extras import MissingExtraError
from tracelock.models import loading, quantize

pytestmark = pytest.mark.usefixtures("one_thread")
SKIP = "torchao is not installed (the quant extra: pip install -c constraints.txt --no-build-isolation -e '.[quant]')"


def _has_torchao() -> bool:
    try:
        quantize.import_torchao()
    except MissingExtraError:
        return False
    return True


needs_torchao = pytest.mark.skipif(not _has_torchao(), reason=SKIP)


@pytest.fixture
def no_weights_read(monkeypatch):
    """Fails the test if `load_model` gets as far as the weight files."""
    def read(folder):
        raise AssertionError(f"the weights of {folder} were read before the refusal")

    monkeypatch.setattr(loading, "_tensor_files", read)


def cli_error(argv, capsys):
    """`tracelock ARGV --threads 1` in this process: (exit status, stderr)."""
    try:
        code = cli.main([*argv, "--threads", "1"])
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err


def test_the_cli_formats_are_the_modules():
    from tracelock.cli_options import QUANTIZE_FORMATS

    assert QUANTIZE_FORMATS == tuple(quantize.FORMATS)


@pytest.mark.parametrize("fmt, needs", [("int4", "compute capability 8.0 or newer"),
                                        ("fp8", "compute capability 9.0 or newer (H100, H200)")])
def test_a_gpu_format_on_the_cpu_is_refused_before_loading(fmt, needs, no_weights_read):
    with pytest.raises(ValueError) as err:
        tracelock.load_model("testbed", quantize=fmt)
    text = str(err.value)
    assert f"quantize={fmt!r}" in text and "cannot run on cpu" in text and needs in text
    assert "quantize='int8' runs" in text  # what would run here


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_the_cli_refuses_a_gpu_format_on_the_cpu_in_its_spelling(fmt, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(loading, "_tensor_files", lambda folder: pytest.fail("weights read"))
    code, err = cli_error(["generate", "--model", "testbed", "--prompt", "hi", "--policy", "threshold",
                           "--gen-length", "16", "--block", "16", "--quantize", fmt], capsys)
    assert code == 2 and err.count("\n") == 1
    assert f"--quantize {fmt} (" in err and "cannot run on cpu" in err and "--quantize int8 runs" in err


def test_an_unknown_format_says_which_was_meant(capsys, no_weights_read):
    with pytest.raises(ValueError, match=r"quantize='int9' is not a format: use int8, int4, fp8 .*did you mean "
                                         r"'int8'\?"):
        tracelock.load_model("testbed", quantize="int9")
    code, err = cli_error(["generate", "--model", "testbed", "--prompt", "hi", "--policy", "threshold",
                           "--gen-length", "16", "--quantize", "int9"], capsys)
    assert code == 2 and "did you mean 'int8'?" in err
    assert quantize.quantize_format(None) is None and quantize.quantize_format("none") is None
    assert quantize.quantize_format(" INT8 ") == "int8"


def test_on_a_gpu_the_capability_and_the_dtype_are_checked(monkeypatch):
    """A GPU too old for the format names itself and its capability; the right GPU in float32 names bfloat16."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    why = quantize.device_refusal("fp8", "cuda", torch.bfloat16)
    assert "cannot run on cuda (NVIDIA A100-SXM4-80GB, compute capability 8.0)" in why and "9.0 or newer" in why
    assert quantize.device_refusal("int4", "cuda", torch.bfloat16) is None
    assert quantize.device_refusal("int8", "cuda", torch.float16) is None
    why = quantize.device_refusal("int4", "cuda", torch.float32, option="--quantize", dtype_option="--model-dtype")
    assert why == ("--quantize int4 runs its products in bfloat16 only, not --model-dtype float32: pass "
                   "--model-dtype bfloat16")
    why = quantize.device_refusal("int4", "cuda", torch.float16)
    assert "not dtype='torch.float16'" in why and "pass dtype=torch.bfloat16" in why
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert quantize.device_refusal("fp8", "cuda", torch.bfloat16) is None


@pytest.fixture
def torchao_missing(monkeypatch):
    for name in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchao", None)  # `import torchao` raises ImportError


def test_a_missing_torchao_names_the_extra(torchao_missing, no_weights_read, capsys, tmp_path, monkeypatch):
    with pytest.raises(MissingExtraError, match=r"quantize='int8' quantizes with torchao, which is not installed "
                                                r".*pip install \"tracelock\[quant\]\""):
        tracelock.load_model("testbed", quantize="int8")
    assert quantize.check_quantize(None, "cpu", torch.float32) is None
    monkeypatch.chdir(tmp_path)
    code, err = cli_error(["eval", "--model", "testbed", "--tasks", "testbed:math", "--limit", "2", "--policies",
                           "confidence", "--quantize", "int8", "--out", "o"], capsys)
    assert code == 2 and "--quantize int8 quantizes with torchao" in err and '-e ".[quant]"' in err
    assert not (tmp_path / "o").exists()  # refused before the run folder was made


@needs_torchao
def test_an_older_torchao_is_refused(monkeypatch, no_weights_read):
    torchao = quantize.import_torchao()
    monkeypatch.setattr(torchao, "__version__", "0.12.0")
    with pytest.raises(MissingExtraError, match=r"torchao 0.12.0 is installed, tracelock needs torchao>=0.18"):
        tracelock.load_model("testbed", quantize="int8")


@pytest.fixture(scope="module")
def testbed_int8():
    if not _has_torchao():
        pytest.skip(SKIP)
    return tracelock.load_model("testbed", quantize="int8")


@pytest.fixture(scope="module")
def testbed_full():
    return tracelock.load_model("testbed")


def test_int8_quantizes_the_block_linears_only(testbed_int8, testbed_full):
    from tracelock.features import backbone_fingerprint

    model = testbed_int8
    assert model.quantization == "int8" and testbed_full.quantization is None
    layers = quantize.quantized_layers(model)
    assert len(layers) == 4 * model.spec.num_layers
    for name in layers:
        weight = model.get_submodule(name).weight
        assert type(weight).__name__ == "Int8Tensor" and weight.dtype == torch.float32  # computes in fp32
    for plain in (model.lm_head.weight, model.embed.weight, model.norm.weight, model.blocks[0].attn_norm.weight):
        assert type(plain) is torch.nn.Parameter and plain.dtype == torch.float32
    got, full = quantize.weight_bytes(model), quantize.weight_bytes(testbed_full)
    assert got["head"] == full["head"] and got["other"] == full["other"]
    # one byte a weight, a 4-byte scale and a 1-byte zero point (0: symmetric) per row, against four bytes a weight
    rows = sum(model.get_submodule(n).weight.shape[0] for n in layers)
    assert got["blocks"] == full["blocks"] // 4 + (4 + 1) * rows
    # the checkpoint's fingerprint: a controller trained on it still matches
    assert backbone_fingerprint(model) == backbone_fingerprint(testbed_full)


def test_int8_products_are_close_and_quantizing_twice_is_refused(testbed_int8, testbed_full):
    x = torch.randn(3, testbed_full.spec.hidden_size, generator=torch.Generator().manual_seed(0))
    for name in ("blocks.0.attn.qkv", "blocks.3.mlp.down_proj"):
        a, b = testbed_full.get_submodule(name), testbed_int8.get_submodule(name)
        x_in = x if a.in_features == x.shape[1] else torch.randn(3, a.in_features)
        want, got = a(x_in), b(x_in)
        assert ((got - want).norm() / want.norm()) < 0.02
    with pytest.raises(ValueError, match="already quantized"):
        quantize.quantize_model(testbed_int8, "int8")


def _prompts(n=6):
    from tracelock.eval.tasks import make_task
    from tracelock.text import encode_prompt

    tok = tracelock.load_tokenizer("testbed")
    return [encode_prompt(tok, it.prompt) for it in make_task("testbed:math@validation").items(n)]


def test_int8_fused_and_reference_loops_agree_and_the_controller_loads(testbed_int8):
    prompts = _prompts()
    for policy, args, schedule in [("threshold", {"tau": 0.9}, dict(block=16)),
                                   ("tracelock", {"controller": "testbed"}, dict(window=16))]:
        got, stats = tracelock.fused_generate(testbed_int8, prompts, policy=policy, policy_args=args, gen_length=32,
                                              impl="torch", **schedule)
        want, ref_stats = tracelock.reference_generate(testbed_int8, prompts, policy=policy, policy_args=args,
                                                       gen_length=32, **schedule)
        assert torch.equal(got, want) and stats.steps == ref_stats.steps, policy


def test_int8_compiles_through_aot_autograd(tmp_path):
    """A compiled step of a quantized model: dynamo captures it whole and AOT autograd traces torchao's weights (the
    backbone's regional compilation cannot take them: each layer is traced inline), the eager loop's rows."""
    if not _has_torchao():
        pytest.skip(SKIP)
    from tracelock.testing import assert_same_decode, decode_on_engine, random_prompts

    model = tracelock.load_model(tracelock.models.write_tiny_checkpoint(tmp_path, family="llada", seed=4),
                                 quantize="int8")
    prompts = random_prompts(model)
    kw = dict(policy="threshold", policy_args={"tau": 0.5}, gen_length=8, block=4, cache="dual")
    rows, engine = decode_on_engine(model, prompts[:2], compile=True, backend="aot_eager", **kw)
    assert engine.compiled
    for r, prompt in enumerate(prompts[:2]):
        assert_same_decode(rows[r], tracelock.fused_generate(model, [prompt], impl="torch", **kw))


def test_eval_records_the_format_and_resumes_only_with_it(tmp_path):
    if not _has_torchao():
        pytest.skip(SKIP)
    from tracelock.eval.runner import parse_policies, parse_settings, run_eval

    args = dict(n=2, batch_size=2, seed=3)
    policies, settings = parse_policies("threshold:tau=0.9"), parse_settings("32/16")
    run_eval("testbed", "testbed:math", policies, settings, tmp_path / "run", quantize="int8", **args)
    import json

    assert json.loads((tmp_path / "run" / "manifest.json").read_text())["quantize"] == "int8"
    with pytest.raises(ValueError, match="holds a run with other quantize"):
        run_eval("testbed", "testbed:math", policies, settings, tmp_path / "run", **args)
    run_eval("testbed", "testbed:math", policies, settings, tmp_path / "run", quantize="int8", **args)  # resumes


def test_lm_eval_model_takes_quantize():
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install tracelock[lm-eval])")
    if not _has_torchao():
        pytest.skip(SKIP)
    from tracelock.eval.lm_eval_model import TraceLockLM

    lm = TraceLockLM(pretrained="testbed", policy="threshold", tau=0.9, gen_length=32, block=16, quantize="int8",
                     device="cpu")
    assert lm.model.quantization == "int8"
    with pytest.raises(ValueError, match="cannot run on cpu"):
        TraceLockLM(pretrained="testbed", gen_length=32, block=16, quantize="fp8", device="cpu")


def test_serve_int8_answers_as_the_offline_path(testbed_int8):
    """The real server on loopback with --quantize int8: each completion's tokens are fused_generate's on the model
    loaded with quantize="int8"."""
    pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install tracelock[serve])")
    openai = pytest.importorskip("openai", reason="the serve extra is not installed (pip install tracelock[serve])")
    from tracelock.eval.tasks import make_task
    from tracelock.serve.process import serving
    from tracelock.text import answer_ids, encode_text

    tok = tracelock.load_tokenizer("testbed")
    server = ["--model", "testbed", "--policy", "threshold:tau=0.9", "--block", "16", "--max-tokens", "32",
              "--max-batch", "4", "--threads", "1", "--quantize", "int8"]
    texts = [tok.apply_chat_template([{"role": "user", "content": it.prompt}], tokenize=False,
                                     add_generation_prompt=True) for it in make_task("testbed:math").items(3)]
    with serving(server) as url:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
        for text in texts:
            ids = encode_text(tok, text)
            got = client.completions.create(model="testbed", prompt=text, max_tokens=32)
            tokens, _ = tracelock.fused_generate(testbed_int8, [ids], policy="threshold", policy_args={"tau": 0.9},
                                                 gen_length=32, block=16, impl="torch")
            want = answer_ids(tokens[0, len(ids):].tolist(), testbed_int8.spec.end_ids)
            assert got.choices[0].model_extra["token_ids"] == want


def test_stored_bytes_of_a_tensor_subclass():
    """A step's floor counts what a quantized weight stores (the tensors it flattens to), not its logical size."""
    from torch.testing._internal.two_tensor import TwoTensor

    weight = torch.nn.Parameter(TwoTensor(torch.zeros(4, 8, dtype=torch.int8), torch.zeros(4, 8, dtype=torch.int8)),
                                requires_grad=False)
    assert quantize.stored_bytes(weight) == 2 * 32
    assert quantize.stored_bytes(torch.zeros(4, 8, dtype=torch.bfloat16)) == 64
