"""`tracelock testbed-train`: train a bundled testbed model with LLaDA's SFT objective.

Optionally the run starts with ``ar_steps`` autoregressive steps (causal mask, next-token loss; see `ar_loss`)
and then switches to LLaDA's objective with a fresh optimiser and schedule, as Dream starts from an AR model:
from scratch, the masked objective collapses the embeddings of interchangeable words (the ten objects of the
math task) before it learns to copy them from the prompt, and never recovers in 20,000 steps; the AR phase
learns the copying in a few hundred steps and the masked phase keeps it.

``family="dream"`` makes a Dream-format checkpoint (Qwen2 keys, Dream's special ids and chat template) and trains
it the way Dream was made: the AR phase, whose output row i - 1 predicts token i, then the masked objective with
the same alignment (`ModelSpec.output_rows`: the row before a masked position predicts it), so the AR phase's
predictions carry over to the masked phase unchanged. A LLaDA model instead switches from shifted (AR) to
unshifted (masked) rows.

Each answer token (the end-of-turn token and the eos padding included) is masked with probability
t ~ U(eps, 1) per row, and the loss is the cross-entropy on masked positions weighted by 1/t, summed and
divided by the answer length (LLaDA's SFT loss). Batches are a pure function of (seed, step), so a run
resumes exactly: the state (fp32 weights, AdamW moments, step, losses) is saved atomically as
safetensors + JSON every ``save_every`` steps; nothing is pickled.

``device="cuda"`` trains on a GPU with the same batches and masks (drawn on the CPU), ``workers`` builds the batches
in background processes; a run reproduces its weights exactly on the device and thread count it ran on.
"""

import contextlib
import dataclasses
import json
import math
import os
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tracelock.atomic import atomic_write_json, atomic_write_text, folder_lock, remove_stale_temps
from tracelock.integrity import load_tensors, read_json, save_tensors
from tracelock.models.backbone import DiffusionBackbone
from tracelock.models.loading import load_tokenizer
from tracelock.models.query import Outputs
from tracelock.models.spec import ModelSpec
from tracelock.progress import progress_bar
from tracelock.tasks import held_out, sample
from tracelock.testbed.model_files import FAMILIES, export_weights, train_tokenizer, write_folder_files
from tracelock.testbed.train_config import BackboneTrainConfig
from tracelock.text import encode_prompt

# the most task texts the tokenizer may train on: a huge --tokenizer-corpus ran in library code for as long as it
# took, past any time limit (found by fuzzing the CLI)
MAX_TOKENIZER_CORPUS = 1_000_000
# the testbed trainer builds small models: fp32 weights with AdamW's two moments and the gradient are 16 bytes per
# parameter, so 500M is already 8 GB; a larger --d-model / --mlp reached torch's allocator as a raw RuntimeError
MAX_TESTBED_PARAMETERS = 500_000_000
MAX_BATCH_SIZE = 65536


def testbed_parameters(cfg) -> int:
    """About how many parameters a fresh testbed model of ``cfg``'s sizes has (embedding and head at the largest
    vocabulary the BPE may learn, positions, attention and the gated MLP per layer)."""
    d, vocab = cfg.d_model, cfg.vocab_size + 64
    return 2 * vocab * d + cfg.max_positions * d + cfg.n_layers * (4 * d * d + 3 * d * cfg.mlp)


def _weights_config(config: dict) -> dict:
    """The settings that determine the weights (JSON-normalised), for the resume check.

    A setting missing from ``config`` (a state saved before the setting existed) takes its default, which
    reproduces the older behaviour: a run saved then resumes when the new setting is left at its default.
    """
    defaults = {f.name: f.default for f in dataclasses.fields(BackboneTrainConfig)
                if f.default is not dataclasses.MISSING}
    full = json.loads(json.dumps({**defaults, **config}))
    return {k: v for k, v in full.items()
            if k not in ("out", "save_every", "threads", "compile", "probe_every", "probe_items", "device",
                         "workers")}


class Batches:
    """Training batches as a pure function of (seed, step): a resumed run sees the same data."""

    def __init__(self, cfg: BackboneTrainConfig, tokenizer, spec):
        self.cfg, self.tok, self.spec = cfg, tokenizer, spec

    def __call__(self, step: int):
        cfg, spec = self.cfg, self.spec
        rng = random.Random(cfg.seed * 1_000_003 + step)
        gen = 128 if rng.random() < cfg.long_fraction else 64
        prompts, answers = [], []
        for i in range(cfg.batch_size):
            # an answer longer than the region is drawn again (never with the shipped tokenizer: the
            # longest of 4,000 sampled answers is 42 tokens; small test tokenizers merge less)
            for _ in range(100):
                ex = sample(cfg.tasks[i % len(cfg.tasks)], "train", rng)
                answer = self.tok(ex.answer, add_special_tokens=False)["input_ids"] + [spec.eot_id]
                if len(answer) <= gen:
                    break
            else:
                raise ValueError(f"{ex.task} answers do not fit {gen} tokens with this tokenizer; raise --vocab-size")
            prompts.append(encode_prompt(self.tok, ex.prompt))
            answers.append(answer)
        # [prompt | answer <|eot_id|> | eos ...]: every row ends at the same length, so the answer region of a
        # shorter prompt is longer; the model learns to fill any tail with eos, as in LLaDA's SFT
        L = max(map(len, prompts)) + gen
        x = torch.full((cfg.batch_size, L), spec.eos_id, dtype=torch.long)
        answer_region = torch.zeros((cfg.batch_size, L), dtype=torch.bool)
        for i, (p, a) in enumerate(zip(prompts, answers)):
            x[i, :len(p)] = torch.tensor(p)
            x[i, len(p):len(p) + len(a)] = torch.tensor(a)
            answer_region[i, len(p):] = True
        return x, answer_region, torch.tensor([len(a) for a in answers])


def block_mask(answer_region, answer_len, t, block_sizes, generator):
    """Masks of the states semi-AR (block or window) decoding visits, with LLaDA's per-row ratio ``t``.

    Per row: a block of ``b`` (drawn from ``block_sizes``) starting inside the answer (at a multiple of ``b`` half the
    time, as blocks are, anywhere otherwise, as the sliding window is); the answer before it is clean, its positions
    are masked with probability ``t``, everything after it is masked. Returns (masked, supervised, block): only the
    block's masked positions carry loss, as the decoder commits only there.
    """
    B, L = answer_region.shape
    start = answer_region.float().argmax(1)
    sizes = torch.tensor(block_sizes)[torch.randint(len(block_sizes), (B,), generator=generator)]
    offset = (torch.rand(B, generator=generator) * answer_len).long()  # answer_len counts the end-of-turn token
    aligned = torch.rand(B, generator=generator) < 0.5
    offset = torch.where(aligned, offset // sizes * sizes, offset)
    pos = torch.arange(L)[None, :] - (start + offset)[:, None]  # position relative to the block's start
    in_block = answer_region & (pos >= 0) & (pos < sizes[:, None])
    supervised = in_block & (torch.rand(B, L, generator=generator) < t[:, None])
    masked = supervised | (answer_region & (pos >= sizes[:, None]))
    return masked, supervised, in_block


def ar_loss(model, x, answer_region):
    """Next-token cross-entropy on the answer region (the answer, <|eot_id|> and one eos; the rest of the
    eos tail is cut, since a causal model never reads past its last token)."""
    end = answer_region & (x != model.spec.eos_id)
    keep = int((end.long() * torch.arange(x.shape[1], device=x.device)).max()) + 2
    x, answer_region = x[:, :keep], answer_region[:, :keep]
    hidden = model(x, outputs=Outputs(logits=False, taps=True), causal=True).taps[2]
    targets = answer_region[:, 1:]
    return F.cross_entropy(model.lm_head(hidden[:, :-1][targets]).float(), x[:, 1:][targets])


def draw_masks(answer_region, answer_len, generator, eps, block_fraction=0.0, block_sizes=(16, 32)):
    """The random part of `sft_loss`, on the CPU: per-row ratios ``t`` and the (masked, supervised, region) masks.

    Drawn from ``generator`` in a fixed order, so a step's masks are the same on every device.
    """
    B, L = answer_region.shape
    # t ~ U(eps, 1) per row, stratified over the batch (row i in [i/B, (i+1)/B) after a shared random shift):
    # each t is still uniform, but every batch covers the whole range, which steadies the 1/t-weighted loss
    u = (torch.arange(B) + torch.rand(1, generator=generator)) / B
    t = eps + (1 - eps) * u[torch.randperm(B, generator=generator)]
    masked = answer_region & (torch.rand(B, L, generator=generator) < t[:, None])
    supervised, region = masked, answer_region
    if block_fraction > 0:
        blockwise = (torch.rand(B, generator=generator) < block_fraction)[:, None]
        b_masked, b_supervised, block = block_mask(answer_region, answer_len, t, block_sizes, generator)
        masked, supervised = torch.where(blockwise, b_masked, masked), torch.where(blockwise, b_supervised, supervised)
        region = torch.where(blockwise, block, region)
    # every row trains on at least one position: the first of its region if the draw masked none there
    none = ~supervised.any(1)
    first = region.float().argmax(1)
    masked[none, first[none]] = True
    supervised[none, first[none]] = True
    return t, masked, supervised, region


def mask_generator(seed: int, step: int) -> torch.Generator:
    """The CPU generator of a step's masks: a pure function of (seed, step), like the batches."""
    return torch.Generator().manual_seed(seed * 7_000_003 + step)


def sft_loss(model, x, answer_region, generator, eps, answer_len=None, block_fraction=0.0, block_sizes=(16, 32)):
    """LLaDA's SFT loss; with ``block_fraction`` > 0 that share of rows is masked by `block_mask` instead."""
    B, L = x.shape
    t, masked, supervised, region = (m.to(x.device) for m in draw_masks(
        answer_region.cpu(), None if answer_len is None else answer_len.cpu(), generator, eps, block_fraction,
        block_sizes))
    noisy = x.masked_fill(masked, model.spec.mask_id)
    hidden = model(noisy, outputs=Outputs(logits=False, taps=True)).taps[2]
    # the output rows that predict the supervised positions (Dream: the row before each; the family's one shift)
    batch_idx, pos = supervised.nonzero(as_tuple=True)
    logits = model.lm_head(hidden[batch_idx, model.spec.output_rows(pos)]).float()
    token_loss = F.cross_entropy(logits, x[supervised], reduction="none") / t[:, None].expand(B, L)[supervised]
    norm = region.sum(1, keepdim=True).expand(B, L)[supervised]
    return (token_loss / norm).sum() / B


def make_optimizer(cfg: BackboneTrainConfig, model) -> torch.optim.AdamW:
    """AdamW with weight decay on the matrices only (not on the norm weights)."""
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))


def _lr(cfg: BackboneTrainConfig, step: int) -> float:
    """Linear warm-up then cosine decay to ``min_lr_ratio``; the AR phase and the masked phase each get one."""
    peak = cfg.lr
    if step < cfg.ar_steps:
        total = cfg.ar_steps
    else:
        step, total = step - cfg.ar_steps, cfg.steps - cfg.ar_steps
        if cfg.ar_steps and cfg.masked_lr is not None:
            peak = cfg.masked_lr
    if step < cfg.warmup:
        return peak * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, total - cfg.warmup)
    return peak * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def probe(model, tokenizer, tasks, n: int) -> dict:
    """Accuracy per task of the family's reference rule (`reference_rule`) at one token per step,
    gen 64, blocks of 16, on the first ``n`` validation items (the test split stays for the reported tables)."""
    from tracelock.testbed.evaluate import evaluate_policy, reference_label, reference_rule

    rule, rule_args = reference_rule(model.spec.family)
    was_training = model.training
    model.eval()
    try:
        return {task: evaluate_policy(model, tokenizer, held_out(task, "validation", n),
                                      reference_label(model.spec.family), rule, rule_args, gen_length=64, block=16,
                                      batch_size=min(n, 100)).accuracy
                for task in tasks}
    finally:
        model.train(was_training)


_RESTORE = "restore the run folder from a copy, or train again into a new --out"


def _save_state(out: Path, model, opt, step: int, log: dict) -> None:
    """Weights and moments in ``train_state-<step>.safetensors``, then ``train_state.json`` naming it: the JSON is
    replaced last, so a kill between the two leaves the previous consistent pair (one file name for every step
    would pair new weights with the old step)."""
    tensors = {f"model/{n}": p.detach().cpu().contiguous() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        for k, v in opt.state.get(p, {}).items():
            tensors[f"opt/{n}/{k}"] = v.detach().reshape(v.shape).cpu().contiguous()
    name = f"train_state-{step:08d}.safetensors"
    save_tensors(out / name, tensors)
    atomic_write_json(out / "train_state.json", {**log, "step": step, "file": name})
    for old in [*out.glob("train_state-*.safetensors"), out / "train_state.safetensors"]:
        if old.name != name:
            old.unlink(missing_ok=True)


def state_file(out) -> Path:
    """The weights-and-moments file that ``train_state.json`` names (``train_state.safetensors`` in older runs)."""
    log = read_json(Path(out) / "train_state.json", fix=_RESTORE)
    return Path(out) / log.get("file", "train_state.safetensors")


def _load_state(out: Path, model, opt) -> tuple:
    log = read_json(out / "train_state.json", fix=_RESTORE)
    tensors = load_tensors(state_file(out), fix=_RESTORE)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(tensors[f"model/{n}"])
    for key, v in tensors.items():
        if key.startswith("opt/"):
            n, k = key[4:].rsplit("/", 1)
            # AdamW keeps its step counters on the CPU (not capturable); the moments live with their parameter
            opt.state[params[n]][k] = v if k == "step" else v.to(params[n].device)
    return log["step"], log


def _check_init(cfg: BackboneTrainConfig) -> None:
    """The ``init`` checkpoint must have the run's family and sizes."""
    spec = ModelSpec.from_pretrained(cfg.init)
    ours = dict(family=cfg.family, hidden_size=cfg.d_model, num_layers=cfg.n_layers, num_heads=cfg.n_heads,
                intermediate_size=cfg.mlp)
    wrong = {k: getattr(spec, k) for k, v in ours.items() if getattr(spec, k) != v}
    if wrong:
        raise ValueError(f"--init {cfg.init} is a checkpoint with {wrong}, but this run asks for "
                         f"{ {k: ours[k] for k in wrong} }; pass the init's family and sizes")


def _build(cfg: BackboneTrainConfig, out: Path):
    """Tokenizer and config files (fresh run: trained, or the ``init`` checkpoint's) or the existing ones (resume),
    and an initialised model (random, or the ``init`` checkpoint's weights)."""
    if cfg.init is not None:
        _check_init(cfg)
    if not (out / "config.json").exists():
        if cfg.init is not None:
            from tracelock.testbed.ship import MODEL_FILES

            # config.json last: a run folder that has it has the others
            for name in sorted(set(MODEL_FILES) - {"model.safetensors"}, key=lambda n: n == "config.json"):
                atomic_write_text(out / name, (Path(cfg.init) / name).read_text())
        else:
            tok = train_tokenizer(cfg.tasks, vocab_size=cfg.vocab_size, corpus_size=cfg.tokenizer_corpus,
                                  seed=cfg.seed, family=cfg.family)
            sizes = dict(d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads, mlp=cfg.mlp)
            write_folder_files(out, tok, sizes, cfg.max_positions, family=cfg.family)
    spec = ModelSpec.from_pretrained(out)
    if spec.family != cfg.family:
        raise ValueError(f"{out} holds a {spec.family} checkpoint but family={cfg.family!r}; resume with "
                         f"--family {spec.family} or choose another --out")
    torch.manual_seed(cfg.seed)
    model = DiffusionBackbone(spec)
    if cfg.init is not None:
        from tracelock.models.loading import load_model

        model.load_state_dict(load_model(cfg.init).state_dict())
        return model, load_tokenizer(out)
    with torch.no_grad():
        # the released layout's tensors (views of the fused products), so a seed draws what it always drew
        for name, p in model.released_weights().items():
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith(".bias"):  # Dream's q/k/v biases start at zero, as in Qwen2
                p.zero_()
            else:
                # small init; output projections scaled down with depth (GPT-2 style)
                std = 0.02 / (math.sqrt(2 * spec.num_layers) if name.endswith(("o_proj.weight", "down_proj.weight"))
                              else 1.0)
                p.normal_(0.0, std)
    return model, load_tokenizer(out)


class _Steps(torch.utils.data.Dataset):
    """Steps ``start .. stop - 1`` as a dataset of whole batches, for `batch_stream`'s worker processes."""

    def __init__(self, batches: Batches, start: int, stop: int):
        self.batches, self.start, self.stop = batches, start, stop

    def __len__(self):
        return self.stop - self.start

    def __getitem__(self, i):
        return self.batches(self.start + i)


def batch_stream(batches: Batches, start: int, stop: int, workers: int = 0, pin_memory: bool = False):
    """The batches of steps ``start .. stop - 1`` in order; with ``workers`` > 0 built ahead in that many processes
    (a DataLoader over steps returns them in step order, so the stream is the same either way)."""
    if workers == 0:
        return (batches(step) for step in range(start, stop))
    # the parent has used the Rust tokenizer; without this every forked worker warns that its threads were dropped
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    steps = _Steps(batches, start, stop)
    return iter(torch.utils.data.DataLoader(steps, batch_size=None, shuffle=False, num_workers=workers,
                                            prefetch_factor=4, pin_memory=pin_memory))


def _training_device(name: str) -> torch.device:
    """``--device`` checked; on CUDA, cuBLAS gets the fixed workspace that deterministic mode needs."""
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"device={name!r} is not a torch device ({e}); pass --device cpu or --device cuda") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' but torch sees no CUDA device here; pass --device cpu")
        # must be set before cuBLAS creates its handle, i.e. before the first matmul on the device
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    elif device.type != "cpu":
        raise ValueError(f"device={name!r}: testbed-train runs on cpu or cuda; pass --device cpu or --device cuda")
    return device


@contextlib.contextmanager
def _deterministic_algorithms():
    """Deterministic kernels while training, the previous mode after.

    Inductor's CPU code adds the embedding gradient (an index_put with accumulate over repeated token ids) with
    atomic adds from several threads, so a compiled step's rounding differed run to run and two runs from one seed
    drifted apart (11 points of math accuracy at the end). In this mode it calls the serial ATen kernel instead.
    """
    previous = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous, warn_only=warn_only)


def check_config(cfg: BackboneTrainConfig) -> None:
    """Refuse settings that are wrong, or that would hang or abort the process (a huge tokenizer corpus, vocabulary
    or model), before any work: every command that builds a testbed model from a `BackboneTrainConfig` calls it."""
    if cfg.family not in FAMILIES:
        raise ValueError(f"family={cfg.family!r}: the testbed model is one of {', '.join(FAMILIES)}; pass --family "
                         "llada or --family dream")
    if not 0 <= cfg.ar_steps < cfg.steps:
        raise ValueError(f"ar_steps={cfg.ar_steps} must be at least 0 and below steps={cfg.steps}: pass "
                         "--ar-steps smaller than --steps (the masked objective needs steps of its own)")
    if not 0 < cfg.vocab_size <= 1 << 17:  # the tokenizers library aborts the whole process on a huge one
        raise ValueError(f"vocab_size={cfg.vocab_size}: the testbed's BPE vocabulary must be in [1, {1 << 17}]; pass "
                         "a smaller --vocab-size")
    if not 0 < cfg.tokenizer_corpus <= MAX_TOKENIZER_CORPUS:  # its texts are generated and trained on in one call
        raise ValueError(f"tokenizer_corpus={cfg.tokenizer_corpus}: the tokenizer trains on 1 to "
                         f"{MAX_TOKENIZER_CORPUS} task texts; pass --tokenizer-corpus in that range (the recipe's: "
                         "20000)")
    sizes = dict(d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads, mlp=cfg.mlp,
                 max_positions=cfg.max_positions, batch_size=cfg.batch_size)
    for name, value in sizes.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer; pass --{name.replace('_', '-')} >= 1")
    if cfg.batch_size > MAX_BATCH_SIZE:
        raise ValueError(f"batch_size={cfg.batch_size}: pass --batch-size at most {MAX_BATCH_SIZE} (the recipe's: "
                         "128)")
    if cfg.init is None and testbed_parameters(cfg) > MAX_TESTBED_PARAMETERS:
        raise ValueError(f"d_model={cfg.d_model}, n_layers={cfg.n_layers}, mlp={cfg.mlp} make about "
                         f"{testbed_parameters(cfg):,} parameters; the testbed trainer builds models of at most "
                         f"{MAX_TESTBED_PARAMETERS:,}: pass smaller --d-model / --n-layers / --mlp (the recipe's: "
                         "128, 4, 512)")
    if cfg.init is None and cfg.d_model % cfg.n_heads:
        raise ValueError(f"d_model={cfg.d_model} is not divisible by n_heads={cfg.n_heads}: pass --d-model a multiple "
                         "of --n-heads (the recipe's: 128 and 2)")


def train_backbone(cfg: BackboneTrainConfig, resume: bool = True, progress: bool = True,
                   stop_after: int | None = None) -> Path:
    """Run (or resume) training; returns the run folder, which holds the final weights when it completes.

    ``stop_after`` ends the process-level run early after that step's state is saved (an interruption). A second
    run into the same folder is refused while this one holds it.
    """
    check_config(cfg)  # bad settings are refused before the run folder exists
    device = _training_device(cfg.device)
    with folder_lock(cfg.out):
        out = _train(cfg, device, resume, progress, stop_after)
        remove_stale_temps(out)  # files a killed run left half-written
    return out


@torch.enable_grad()  # trains whatever the caller's grad mode (inside torch.no_grad() too)
def _train(cfg: BackboneTrainConfig, device: torch.device, resume: bool, progress: bool,
           stop_after: int | None) -> Path:
    out = Path(cfg.out)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    fresh = not (out / "train_state.json").exists()
    if not fresh and not resume:
        raise FileExistsError(f"{out} holds a training run; pass --resume to continue it or choose another --out")
    model, tok = _build(cfg, out)
    model.to(device).train()
    opt = make_optimizer(cfg, model)
    start, log = 0, {"config": dataclasses.asdict(cfg), "loss": [], "seconds": 0.0}
    if not fresh:
        start, log = _load_state(out, model, opt)
        if _weights_config(log["config"]) != _weights_config(dataclasses.asdict(cfg)):
            raise ValueError(f"{out} was trained with another configuration; resume with the same arguments")
    batches = Batches(cfg, tok, model.spec)
    # dynamic: one graph for every sequence length (prompts and generation regions vary per batch)
    loss_fn = torch.compile(sft_loss, dynamic=True) if cfg.compile else sft_loss
    bar = progress_bar(range(start, cfg.steps), initial=start, total=cfg.steps, disable=not progress, desc="train",
                       unit="step")
    with _deterministic_algorithms():
        t0, window = time.perf_counter(), []
        stream = batch_stream(batches, start, cfg.steps, cfg.workers, pin_memory=device.type == "cuda")
        for step, (x, region, answer_len) in zip(bar, stream):
            if step == cfg.ar_steps > 0:
                opt = make_optimizer(cfg, model)  # the masked phase starts afresh (moments of the AR loss dropped)
            # the region stays on the CPU for the masked loss, whose masks are drawn there (`draw_masks`)
            x = x.to(device, non_blocking=True)
            for group in opt.param_groups:
                group["lr"] = _lr(cfg, step)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
                if step < cfg.ar_steps:
                    loss = ar_loss(model, x, region.to(device))
                else:
                    loss = loss_fn(model, x, region, mask_generator(cfg.seed, step), cfg.eps, answer_len,
                                   cfg.block_fraction, cfg.block_sizes)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            window.append(loss.item())
            if (step + 1) % 10 == 0:
                log["loss"].append([step + 1, sum(window) / len(window)])
                bar.set_postfix(loss=f"{log['loss'][-1][1]:.3f}")
                window = []
            if cfg.probe_every and (step + 1) % cfg.probe_every == 0:
                log["seconds"] += time.perf_counter() - t0  # probes are not training time
                accuracy = probe(model, tok, cfg.tasks, cfg.probe_items)
                log.setdefault("probes", {})[str(step + 1)] = accuracy
                bar.write(f"step {step + 1}: " + ", ".join(f"{task} {acc:.0%}" for task, acc in accuracy.items()))
                t0 = time.perf_counter()
            if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
                log["seconds"] += time.perf_counter() - t0
                t0 = time.perf_counter()
                _save_state(out, model, opt, step + 1, log)
            if stop_after is not None and step + 1 >= stop_after:
                return out
    export_weights(out, model.cpu())
    return out
