"""Bad input at the public API: each case is one error that names the argument and the fix, raised before any
decoding, instead of a silent misreading or a raw message from inside torch."""

import pytest
import torch

import tracelock
from tracelock.testing import fresh_controller


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tracelock.write_tiny_checkpoint(tmp_path_factory.mktemp("a") / "m", family="llada")


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return tracelock.load_model(tiny_dir)


@pytest.fixture(scope="module")
def twin(tmp_path_factory):
    """Another checkpoint of exactly the same shape: other weights (seed 1)."""
    folder = tracelock.write_tiny_checkpoint(tmp_path_factory.mktemp("b") / "m", family="llada", seed=1)
    return tracelock.load_model(folder)


def decode(model, ids, **kwargs):
    kwargs = {"policy": "confidence", "gen_length": 8, **kwargs}
    return tracelock.fused_generate(model, ids, **kwargs)


@pytest.mark.parametrize("generate", [tracelock.fused_generate, tracelock.reference_generate])
def test_a_flat_list_of_ids_is_refused_not_split_into_one_token_prompts(tiny, generate):
    with pytest.raises(TypeError, match=r"input_ids is a flat list of token ids .* wrap one prompt in a list, \[ids\]"):
        generate(tiny, [5, 6, 7], policy="confidence", gen_length=8)
    tokens, stats = generate(tiny, [[5, 6, 7]], policy="confidence", gen_length=8)
    assert tokens.shape == (1, 11) and len(stats.steps) == 1


def test_generate_many_refuses_a_flat_list(tiny):
    with pytest.raises(TypeError, match="prompts is a flat list of token ids"):
        tracelock.generate_many(tiny, [5, 6, 7], batch_size=2, policy="confidence", gen_length=8)


@pytest.mark.parametrize("ids", [[[5.0, 6.7, 7.0]], [torch.tensor([5.0, 6.0])], [[5, True]]],
                         ids=["floats", "float-tensor", "bool"])
def test_non_integer_ids_are_refused_not_truncated(tiny, ids):
    with pytest.raises(TypeError, match=r"input_ids\[0\]"):
        decode(tiny, ids)


@pytest.mark.parametrize("bad", [10_000, -1])
def test_ids_outside_the_vocabulary_name_the_position_and_the_tokenizer(tiny, bad):
    V = tiny.spec.vocab_size
    with pytest.raises(ValueError, match=rf"input_ids\[1\]\[2\] = {bad} is outside this model's vocabulary "
                                         rf"\[0, {V}\); .*load_tokenizer"):
        decode(tiny, [[5, 6, 7], [5, 6, bad]])
    with pytest.raises(ValueError, match=rf"input_ids\[0\]\[1\] = {bad} is outside"):
        decode(tiny, torch.tensor([[5, bad, 7]]))


def test_policy_args_must_be_a_mapping(tiny):
    with pytest.raises(TypeError, match=r"policy_args must be a dict .*\{'tau': 0.9\}, got list"):
        decode(tiny, [[5, 6]], policy="threshold", policy_args=[0.9])


def test_a_policy_without_its_required_argument_says_which(tiny):
    with pytest.raises(TypeError, match=r"policy 'tracelock' needs controller \(a `tracelock train --out` folder\): "
                                        r"pass policy_args=\{'controller': \.\.\.\}"):
        decode(tiny, [[5, 6]], policy="tracelock")
    with pytest.raises(TypeError, match="policy 'l2p' needs filters"):
        decode(tiny, [[5, 6]], policy="l2p")


@pytest.mark.parametrize("args, message", [
    ({"tau": "abc"}, "policy 'threshold': tau='abc' is not a number; pass a number, e.g. tau=0.9"),
    ({"first_token": "yes"}, "first_token='yes' must be a bool"),
])
def test_a_value_of_the_wrong_kind_is_named_as_such(tiny, args, message):
    with pytest.raises(TypeError, match=message):
        decode(tiny, [[5, 6]], policy="threshold", policy_args=args)
    with pytest.raises(TypeError, match=r"steps=2.5 is not an int"):
        decode(tiny, [[5, 6]], policy_args={"steps": 2.5})
    # out of range stays out of range
    with pytest.raises(ValueError, match=r"tau=1.5 must lie in \(0, 1\]"):
        decode(tiny, [[5, 6]], policy="threshold", policy_args={"tau": 1.5})


@pytest.mark.parametrize("kwargs, exc, message", [
    (dict(policy="klass", policy_args={"kl": -1}), ValueError,
     r"^policy 'klass': kl=-1 must be a finite number > 0 \(KLASS's kl_threshold"),
    (dict(policy="klass", policy_args={"tau": 2}), ValueError, r"^policy 'klass': tau=2 must lie in \(0, 1\]"),
    (dict(policy="klass", policy_args={"form": "llama"}), ValueError, r"form='llama' must be one of llada, dream"),
    (dict(policy="klass", policy_args={"history": 0}), ValueError, r"history=0 must be an int >= 1"),
    (dict(policy="credit", policy_args={"alpah": 0.5}), TypeError,
     r"^policy 'credit' takes no argument alpah; its arguments are: tau, alpha, .*; did you mean 'alpha'\?"),
    (dict(policy="credit", policy_args={"beta": 1.5}), ValueError, r"^policy 'credit': beta=1.5 must lie in \[0, 1\]"),
    (dict(policy="less", policy_args={"drift": 1}), ValueError, r"^policy 'less': drift=1 must lie in \[0, ln 2"),
    (dict(policy="less", policy_args={"persistence_len": 2}), TypeError, r"did you mean 'persist'\?"),
    (dict(policy="eb", policy_args={"gamma": "abc"}), TypeError, r"^policy 'eb': gamma='abc' is not a number"),
    (dict(policy="hierarchy", policy_args={"low": 1}), ValueError, r"^policy 'hierarchy': low=1 must lie in \[0, 1\)"),
    (dict(policy="pc"), TypeError, r"^policy 'pc' needs background \(.*\): pass policy_args=\{'background': \.\.\.\}"),
    (dict(policy="pc", policy_args={"background": "missing.json", "lambd": 0.25}), ValueError,
     r"^policy 'pc': background='missing.json': no such file; pass a PC-Sampler table"),
    (dict(policy="pc", policy_args={"background": "testbed", "alpha": 0}), ValueError, r"alpha=0 must be a finite "
                                                                                     r"number > 0"),
    (dict(policy="credit", window=16), ValueError, r"^policy 'credit' keeps a memory per slot of a block, which a "
                                                   r"sliding window moves: use block=N .* not window=16"),
    (dict(policy="less", window=8), ValueError, r"not window=8"),
    (dict(policy="klass", temperature=0.5), ValueError,
     r"^policy 'klass' decodes greedily, as its authors' code is checked here: pass temperature=0, not 0.5"),
    (dict(policy="klss"), ValueError, r"unknown policy 'klss'.*did you mean 'klass'\?"),
    (dict(policy="klass:kl=0.01"), ValueError, r"policy='klass:kl=0.01' is the command line's spec; in Python pass "
                                               r"the name and its arguments apart: policy='klass', "
                                               r"policy_args=\{'kl': 0.01\}"),
])
def test_the_rules_since_fastdllm_name_a_bad_knob_and_the_fix(tiny, kwargs, exc, message):
    with pytest.raises(exc, match=message):
        decode(tiny, [[5, 6]], **{"gen_length": 16, **kwargs})


def test_the_rules_since_fastdllm_decode_with_their_knobs(tiny):
    for policy, args in (("hierarchy", {"tau": None, "low": 0.3}), ("credit", {"alpha": 0}), ("klass", {"kl": 0.01}),
                         ("less", {"per_step": 2}), ("eb", {"gamma": 1.0}), ("pc", {"background": "testbed"})):
        tokens, stats = decode(tiny, [[5, 6]], policy=policy, policy_args=args, gen_length=16, block=8)
        assert tokens.shape == (1, 18) and 1 <= stats.steps[0] <= 16, policy


def test_a_controller_path_that_does_not_exist_is_named(tiny, tmp_path):
    missing = tmp_path / "no-such-run"
    with pytest.raises(FileNotFoundError, match=f"controller='{missing}' does not exist; pass a `tracelock train "
                                                "--out` folder"):
        decode(tiny, [[5, 6]], policy="tracelock", policy_args={"controller": str(missing)})


def test_a_controller_of_another_backbone_of_the_same_shape_is_refused(tiny, twin, tmp_path):
    fresh_controller(tiny, folder=tmp_path / "ctrl")
    assert twin.spec == tiny.spec  # same config: only the weights tell them apart
    args = {"controller": str(tmp_path / "ctrl")}
    tokens, _ = decode(tiny, [[5, 6]], policy="tracelock", policy_args=args, window=4)
    with pytest.raises(ValueError, match="was fit on another backbone of the same shape"):
        decode(twin, [[5, 6]], policy="tracelock", policy_args=args, window=4)
    # the controller object with its encoder: the controller's own fingerprint refuses it too
    from tracelock.policies.tracelock import TraceLockPolicy

    controller, encoder = fresh_controller(tiny)
    with pytest.raises(ValueError, match="this controller was trained for another backbone of the same shape"):
        TraceLockPolicy(controller, encoder, model=twin)


def test_the_same_checkpoint_in_another_dtype_keeps_its_controller(tiny, tiny_dir, tmp_path):
    from tracelock.policies.tracelock import TraceLockPolicy

    fresh_controller(tiny, folder=tmp_path / "ctrl")
    TraceLockPolicy(str(tmp_path / "ctrl"), model=tracelock.load_model(tiny_dir, dtype=torch.bfloat16))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a CPU-only machine")
def test_cuda_without_cuda_names_the_device_and_the_fix():
    with pytest.raises(ValueError, match=r"device='cuda' but this torch \(.*\) (is a CPU-only build|finds no usable "
                                         r"GPU); use device='cpu'"):
        tracelock.load_model("testbed", device="cuda")


def test_one_function_resolves_a_named_policy():
    """`resolve_policy` is the one reading of a named policy (the decode's, the commands' and the server's checks,
    `make_policy`): the same words wherever a policy is named, per_step as steps, set up on request."""
    from tracelock.policies import make_policy, resolve_policy

    policy = resolve_policy("confidence", {"per_step": 2}, gen_length=64, num_regions=4)
    assert policy.steps == 32 and policy.steps_per_region() == 8
    assert resolve_policy(policy) is policy
    with pytest.raises(TypeError, match=r"pass the name instead"):
        resolve_policy(policy, {"steps": 4})
    for build in (lambda: make_policy("threshold", taux=0.9), lambda: resolve_policy("threshold", {"taux": 0.9})):
        with pytest.raises(TypeError, match=r"^policy 'threshold' takes no argument taux; .*did you mean 'tau'\?"):
            build()
    with pytest.raises(ValueError, match=r"^policy 'confidence': steps=10 is not a multiple of num_regions=4"):
        resolve_policy("confidence", {"steps": 10}, gen_length=32, num_regions=4)
    with pytest.raises(TypeError, match=r"^policy 'confidence': per_step \(tokens per step\) needs the generation"):
        make_policy("confidence", per_step=2)
    # before the files and the model are at hand: a learned policy's arguments are checked, it is not built
    assert resolve_policy("tracelock", {"theta": 0.5}, load=False) is None
    with pytest.raises(TypeError, match=r"^policy 'tracelock' takes no argument thetta; .*did you mean 'theta'\?"):
        resolve_policy("tracelock", {"thetta": 0.5}, load=False)
