"""The backbone step fused: q/k/v and gate/up as one product each under the released names, the per-layer ops
(`ops.op_set`) chosen once, their Triton kernels in a whole decode (interpreted on the CPU) giving the
reference's tokens, and every engine backbone variant decoding the same tokens (fp32 CPU)."""

import pytest
import torch

import tracelock
from tracelock import ops
from tracelock.models.keys import official_keys
from tracelock.testing import assert_same_decode, decode_on_engine, eos_prone_model, random_prompts

pytestmark = pytest.mark.usefixtures("one_thread")
G = 16


@pytest.fixture(scope="module", params=["llada", "dream"])
def model(request, tmp_path_factory):
    return eos_prone_model(tmp_path_factory.mktemp(request.param), request.param, G)


def test_the_released_names_are_views_of_the_fused_products(model):
    released = model.released_weights()
    assert set(released) == set(official_keys(model.spec).values())
    attn, mlp = model.blocks[0].attn, model.blocks[0].mlp
    q = released["blocks.0.attn.q_proj.weight"]
    assert q.data_ptr() == attn.qkv.weight.data_ptr() and q.shape[0] == attn.n_heads * attn.head_dim
    up = released["blocks.0.mlp.up_proj.weight"]
    assert up.data_ptr() == mlp.gate_up.weight[mlp.intermediate:].data_ptr()
    # the parameters a forward reads are the fused ones: no separate q/k/v or gate/up tensors exist
    names = {n for n, _ in model.named_parameters()}
    assert "blocks.0.attn.qkv.weight" in names and not any("q_proj" in n or "gate_proj" in n for n in names)


def test_the_forward_ops_are_chosen_once(monkeypatch):
    # the eager loop never runs the CPU interpreter for the backbone unless asked: every layer would pay for it
    def per_layer(op_set):
        return {op_set.impls[op] for op in ops.PER_LAYER}

    assert per_layer(ops.op_set("cpu")) == {"torch"}
    assert per_layer(ops.op_set("cpu", "graph", backbone="kernels+matmul")) == {"torch"}
    with pytest.raises(ValueError, match="backbone='fused' must be one of kernels, specs, kernels\\+matmul"):
        ops.op_set("cpu", backbone="fused")
    monkeypatch.setenv("TRACELOCK_IMPL", "torch")
    assert per_layer(ops.op_set("cpu")) == {"torch"}


@pytest.mark.parametrize("cache", [None, "dual"], ids=["nocache", "dual"])
def test_the_triton_backbone_kernels_decode_the_reference_tokens(model, cache):
    """impl="triton": the fused residual add + RMSNorm, the rotary kernel writing K/V into the cache and SiLU x mul
    in every layer (interpreted), then the head, fold and commit kernels: the reference's tokens and steps."""
    from tracelock import _triton

    if not _triton.triton_interpret:
        pytest.skip("the Triton kernels run on a CPU only under TRITON_INTERPRET=1 (tests/conftest.py sets it)")
    assert {ops.op_set("cpu", impl="triton").impls[op] for op in ops.PER_LAYER} == {"triton"}
    prompts = random_prompts(model)[:2]
    kw = dict(policy="threshold", policy_args={"tau": 0.7}, gen_length=G, window=8, cache=cache)
    ref, ref_stats = tracelock.reference_generate(model, prompts, **kw)
    got, stats = tracelock.fused_generate(model, prompts, impl="triton", **kw)
    assert torch.equal(got, ref) and stats.steps == ref_stats.steps
    assert stats.commits_per_step == ref_stats.commits_per_step


@pytest.mark.parametrize("backbone", ["specs", "kernels+matmul"])
def test_every_engine_backbone_decodes_the_same_tokens(model, backbone):
    """On a CPU each variant runs torch implementations (the products' epilogues by linear_rows' spec): the same
    fp32 tokens as fused_generate, prompt by prompt, with the dual cache's in-place K/V writes."""
    prompts = random_prompts(model)
    kw = dict(policy="threshold", policy_args={"tau": 0.7}, gen_length=G, block=4, cache="dual")
    rows, engine = decode_on_engine(model, prompts, backbone=backbone, **kw)
    assert engine.ops.epilogues == (backbone == "kernels+matmul")
    for r, prompt in enumerate(prompts):
        assert_same_decode(rows[r], tracelock.fused_generate(model, [prompt], **kw), f"{backbone} row {r}")


def test_one_block_is_compiled_and_reused_for_every_layer(model):
    """Regional compilation: under torch.compile a `Block` is one nested region; the layers after the first (which
    has no previous MLP output to add) all call the same compiled subgraph, and the output is the eager one."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    ids = torch.tensor(random_prompts(model)[:1])
    with torch.no_grad():
        got = torch.compile(lambda x: model(x).logits, backend=backend, fullgraph=True)(ids)
        want = model(ids).logits
    assert torch.equal(got, want) and len(graphs) == 1
    calls = [n for n in graphs[0].graph.nodes if n.op == "call_function" and "invoke_subgraph" in str(n.target)]
    assert len(calls) >= model.spec.num_layers - 1
    assert len({str(n.args[1]) for n in calls}) == 1  # one subgraph identifier: the layers share their code
