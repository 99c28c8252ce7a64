"""`tracelock serve`: the OpenAI-compatible server (`tracelock.serve.app`) on uvicorn.

Uvicorn + FastAPI: a maintained ASGI stack whose streaming responses are cancelled when the client disconnects
(which is how a dropped stream frees its batch slot), with pydantic (already FastAPI's) for strict request bodies.
"""

import contextlib
import os
import signal
import socket
import threading
from pathlib import Path

from tracelock.serve.memory import tune_malloc

DEFAULT_POLICIES = "threshold:tau=0.9"
# the key clients must send when --api-key is not given (keeps it off the command line, where `ps` shows it)
API_KEY_ENV = "TRACELOCK_API_KEY"


def _listening_socket(host: str, port: int) -> socket.socket:
    """A bound socket (``port`` 0: any free one), so the real port is known before uvicorn starts."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise ValueError(f"--host {host} --port {port}: cannot listen there ({err.strerror}); pick another port "
                         "(or 0 for any free one)") from None
    return sock


def _gen_lengths(text: str | None):
    from tracelock.cli_values import MAX_GEN_LENGTH

    if text is None:
        return None
    try:
        lengths = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1 or max(lengths) > MAX_GEN_LENGTH:
        raise ValueError(f"--gen-lengths {text!r} must be comma-separated ints in 1..{MAX_GEN_LENGTH}, e.g. 64,128,256")
    return lengths


def served_policies_text(args) -> tuple[str, str]:
    """(the allowed policies' specs, the option that gave them): ``--policies`` (a list), or ``--policy`` as before:
    one spec, or, deprecated, a list (its old meaning)."""
    from tracelock.cli_parser import warn_deprecated
    from tracelock.policy_specs import expand_policy_list

    policies, policy = getattr(args, "policies", None), getattr(args, "policy", None)
    if policies is not None and policy is not None:
        raise ValueError(f"--policy {policy} and --policies {policies}: give the policies a request may choose once, "
                         "as --policies SPEC,SPEC (the first is the default)")
    if policy is not None:
        try:
            several = len(expand_policy_list(policy, option="--policy")) > 1
        except ValueError:
            several = False  # the error is parse_served_policies's to name
        if several:
            warn_deprecated("tracelock serve", "--policy with several policies", f"--policies {policy}")
        return policy, "--policy"
    return policies if policies is not None else DEFAULT_POLICIES, "--policies"


def serve_config(args, max_positions: int):
    """The `ServeConfig` of the command line (checked before the model loads)."""
    from tracelock.cli_values import MAX_BATCH, MAX_COUNT, MAX_GEN_LENGTH
    from tracelock.serve.config import ServeConfig, parse_served_policies

    if args.default_max_tokens is None:
        args.default_max_tokens = min(128, args.max_tokens)
    # bounded before the model loads: each sizes what the server allocates or holds
    ceilings = dict(max_batch=MAX_BATCH, max_tokens=MAX_GEN_LENGTH, default_max_tokens=MAX_GEN_LENGTH,
                    max_engines=1024, max_waiting=MAX_COUNT)
    for name, most in ceilings.items():
        if getattr(args, name) < 1 and name != "max_waiting":
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
        if getattr(args, name) > most:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)} is more than {most:,}; pass at most "
                             f"{most}")
    if args.max_tokens >= max_positions:
        raise ValueError(f"--max-tokens {args.max_tokens} leaves no room for a prompt in the model's {max_positions} "
                         f"positions; pass at most {max_positions - 1} less the prompts' tokens")
    if args.max_waiting < 0:
        raise ValueError(f"--max-waiting {args.max_waiting} must be >= 0 (0: refuse every request beyond "
                         "--max-batch)")
    if not args.drain_timeout >= 0:  # also refuses nan
        raise ValueError(f"--drain-timeout {args.drain_timeout} must be >= 0 seconds")
    if args.default_max_tokens > args.max_tokens:
        raise ValueError(f"--default-max-tokens {args.default_max_tokens} exceeds --max-tokens {args.max_tokens}")
    block = args.block if args.block or args.window else 32
    text, option = served_policies_text(args)
    try:
        policies = parse_served_policies(text, block=block, window=args.window, cache=args.cache)
    except ValueError as err:  # its messages name --policy
        raise ValueError(str(err).replace("--policy", option, 1)) from None
    name = args.served_model_name or Path(str(args.model)).name
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise ValueError("--served-model-name is empty; give the model id clients send, e.g. LLaDA-8B-Instruct")
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    if api_key is not None and (not api_key.strip() or any(c.isspace() for c in api_key)):
        raise ValueError("--api-key must be a non-empty key without spaces (clients send it as 'Bearer KEY')")
    gen_lengths = _gen_lengths(args.gen_lengths)
    try:
        config = ServeConfig(model_name=name, policies=policies, max_positions=max_positions,
                             max_tokens=args.max_tokens, default_max_tokens=args.default_max_tokens,
                             max_batch=args.max_batch, gen_lengths=gen_lengths, api_key=api_key)
    except ValueError as err:  # its messages name --policy
        raise ValueError(str(err).replace("--policy ", option + " ", 1)) from None
    check_rules(config, option)
    return config


def check_rules(config, option: str = "--policies") -> None:
    """Every served policy's arguments, and the values of each that needs no model or files from disk (a learned one
    is built once the model loads, with --controller / --l2p), as `fused_generate` checks them
    (`tracelock.policies.resolve_policy`): a bad argument or value (``klass:tau=2``, ``credit:alpah=0.5``) is one
    error line naming it, and the argument meant, before the model loads."""
    from tracelock.policies import resolve_policy

    for p in config.policies:
        gen_length = config.gen_lengths[0] if config.gen_lengths else p.width  # one the server runs
        try:
            resolve_policy(p.name, p.args, gen_length=gen_length, load=False)
        except (ValueError, TypeError) as err:
            raise ValueError(f"{option} {p.label}: {err}") from None


def build_state(args):
    """Load the model and tokenizer and make the scheduler and config (everything but the HTTP server)."""
    import torch

    from tracelock.eval.runner import PolicySpec, build_policy
    from tracelock.models import load_model, load_tokenizer
    from tracelock.models.loading import resolve_path
    from tracelock.models.spec import ModelSpec
    from tracelock.serve.app import ServerState
    from tracelock.serve.metrics import Metrics
    from tracelock.serve.scheduler import Scheduler

    serve_config(args, ModelSpec.from_pretrained(resolve_path(args.model)).max_positions)  # bad options: fail now
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.model, dtype=getattr(torch, args.model_dtype), device=args.device,
                       quantize=args.quantize)
    tokenizer = load_tokenizer(args.model)
    config = serve_config(args, model.spec.max_positions)
    for p in config.policies:  # a policy that cannot be built (e.g. tracelock without --controller) fails now
        gen_length = config.gen_lengths[0] if config.gen_lengths else p.width  # one the server runs
        build_policy(PolicySpec(p.label, p.name, p.policy_args(gen_length)), model, controller=args.controller,
                     l2p=args.l2p)
    metrics = Metrics(args.max_batch)
    scheduler = Scheduler(model, tokenizer, max_batch=args.max_batch, metrics=metrics, controller=args.controller,
                          l2p=args.l2p, compile={None: False, "inductor": True}.get(args.compile, args.compile),
                          max_engines=args.max_engines, max_waiting=args.max_waiting)
    return ServerState(config=config, tokenizer=tokenizer, scheduler=scheduler, metrics=metrics,
                       mask_id=model.spec.mask_id)


def _draining_server(uvicorn, state):
    """A uvicorn server whose SIGTERM / SIGINT drains: new requests are refused (503; the listening socket closes),
    those in the server finish (up to ``timeout_graceful_shutdown``), then ``run`` returns and the process exits 0.
    (Uvicorn's own handler re-raises the signal after its shutdown, so the process would end killed by it.)"""

    class DrainingServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig, frame):
            if not state.draining:
                print(f"tracelock serve: {signal.Signals(sig).name}: finishing the requests in the server, then "
                      "exiting", flush=True)
            state.draining = True
            if self.should_exit and sig == signal.SIGINT:  # a second Ctrl-C: stop now
                self.force_exit = True
            self.should_exit = True

    return DrainingServer


def run_serve(args) -> int:
    try:
        import uvicorn

        from tracelock.serve.app import create_app
    except ImportError as err:
        raise ValueError(f"tracelock serve needs the serve extra ({err.name} is missing): "
                         "pip install tracelock[serve]") from None
    sock = _listening_socket(args.host, args.port)
    tune_malloc()  # before the model's buffers are allocated and the threads start: see tracelock.serve.memory
    state = build_state(args)
    state.scheduler.start()
    host, port = sock.getsockname()[:2]
    print(f"tracelock serve: {state.config.model_name} on http://{args.host}:{port}/v1 "
          f"(policies {', '.join(p.label for p in state.config.policies)}; max batch {args.max_batch}"
          f"{'; API key required' if state.config.api_key else ''})",
          flush=True)
    server = _draining_server(uvicorn, state)(uvicorn.Config(create_app(state), log_level=args.log_level,
                                                             timeout_graceful_shutdown=args.drain_timeout))
    try:
        server.run(sockets=[sock])
    finally:
        state.scheduler.stop()
    if state.draining:
        print("tracelock serve: stopped", flush=True)
    return 0


def add_parsers(sub) -> None:
    from tracelock.cli_options import (
        add_block_or_window,
        add_device,
        add_model,
        add_model_dtype,
        add_quantize,
        option_help,
    )
    from tracelock.cli_values import bounded_int, gen_length_int

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching at step granularity")
    add_model(p)
    p.add_argument("--served-model-name", help="the model id clients send and /v1/models lists (default: the folder's "
                                               "name, or testbed)")
    p.add_argument("--api-key", help="require this key on /v1/* (Authorization: Bearer KEY, the openai client's "
                                     "api_key); other requests get a 401. /health and /metrics stay open (default: "
                                     f"${API_KEY_ENV}, else no key)")
    p.add_argument("--policies", metavar="SPEC,SPEC",
                   help=option_help("--policies", "the policies a request may choose (its \"policy\" field), the "
                                                  "first the default; block=N / window=N / cache=... in a spec set "
                                                  "its schedule") + f" (default: {DEFAULT_POLICIES})")
    p.add_argument("--policy", metavar="SPEC",
                   help=option_help("--policy", "the one policy requests get, the same as --policies SPEC (a list "
                                                "here is the old spelling of --policies, deprecated)") +
                   f" (default: --policies {DEFAULT_POLICIES})")
    p.add_argument("--controller", help="a `tracelock train --out` folder, for the tracelock policy (default: none)")
    p.add_argument("--l2p", help="a `tracelock train-l2p --out` folder, for the l2p policies (default: none)")
    add_block_or_window(p, block_help="; max_tokens is rounded up to a multiple (default 32 when neither --block nor "
                                      "--window is given)",
                        window_help="; max_tokens is rounded up to a multiple (default: none, blocks)")
    p.add_argument("--cache", choices=["prefix", "dual"], help="approximate KV cache (default: none)")
    p.add_argument("--max-batch", type=int, default=16,
                   help="rows decoding at once over every decode setting together; more requests wait (default 16)")
    p.add_argument("--max-tokens", type=int, default=256,
                   help="the largest max_tokens a request may ask (default 256)")
    p.add_argument("--default-max-tokens", type=int,
                   help="max_tokens of a request that sends none (default: 128, or --max-tokens if lower)")
    p.add_argument("--gen-lengths", metavar="N,N,...",
                   help="comma-separated generation lengths engines run, e.g. 64,256: a request's max_tokens maps to "
                        "the shortest that holds it (default: max_tokens rounded up to a multiple of the block / "
                        "window). Fewer lengths, fuller batches")
    p.add_argument("--gen-length", type=gen_length_int, metavar="N",
                   help=option_help("--gen-length", "here the one generation length engines run, the same as "
                                                    "--gen-lengths N (default: --gen-lengths)"))
    p.add_argument("--settings", metavar="GEN/WIDTH,...",
                   help=option_help("--settings", "here the generation lengths engines run and the block, one WIDTH: "
                                                  "the same as --gen-lengths GEN,... --block WIDTH") +
                   " (default: --gen-lengths and --block)")
    p.add_argument("--max-engines", type=int, default=8,
                   help="decode engines kept (one per policy, generation length, temperature and prompt bucket in "
                        "use); idle ones are dropped beyond it (default 8)")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="requests that may wait for a slot beyond --max-batch; more are answered 429 with a "
                        "Retry-After header at once (default 256)")
    p.add_argument("--drain-timeout", type=float, default=60.0,
                   help="on SIGTERM / Ctrl-C, seconds the requests in the server get to finish before they are "
                        "cancelled (default 60)")
    add_model_dtype(p, old=())
    add_quantize(p)
    add_device(p)
    p.add_argument("--compile", nargs="?", const="inductor", choices=["inductor", "cudagraphs"],
                   help="compile the decode steps: inductor (torch.compile; with CUDA graphs on CUDA) or cudagraphs "
                        "(CUDA only: the eager steps captured as CUDA graphs, no compile time); the first requests of "
                        "each setting and row count wait for it (default: eager; --compile alone: inductor)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1, this machine only)")
    p.add_argument("--port", type=bounded_int(65535, "TCP ports", minimum=0), default=8000,
                   help="port to listen on; 0 picks a free one (default 8000)")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default warning)")
    p.checks.append(_one_grammar)
    p.set_defaults(func=run_serve)


def _one_grammar(args) -> None:
    """Every decoding command's spellings of the setting: ``--gen-length N`` is ``--gen-lengths N``, ``--settings
    64/16,128/16`` is ``--gen-lengths 64,128 --block 16``."""
    from tracelock.cli_options import check_settings

    given = [o for o, v in (("--gen-length", args.gen_length), ("--settings", args.settings),
                            ("--gen-lengths", args.gen_lengths)) if v is not None]
    if len(given) > 1:
        raise ValueError(f"{' and '.join(given)}: give the generation lengths once")
    if args.gen_length is not None:
        args.gen_lengths = str(args.gen_length)
    if args.settings is not None:
        pairs = check_settings(args.settings)
        widths = sorted({w for _, w in pairs})
        if len(widths) > 1:
            raise ValueError(f"--settings {args.settings}: one server runs one block width (--block W), here "
                             f"{', '.join(map(str, widths))}; serve one width, or give a policy its own with "
                             "block=N in --policies")
        if args.block not in (None, widths[0]) or args.window is not None:
            raise ValueError(f"--settings {args.settings} sets --block {widths[0]}; drop --block / --window")
        args.gen_lengths, args.block = ",".join(str(g) for g, _ in pairs), widths[0]
