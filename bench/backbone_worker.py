"""One decode setting served over stdin, from a given source tree (bench/test_bench_fused_backbone.py starts one per
tree: the checkout, and the tree before the fused backbone). Each line read is a command; each answer one JSON line:
``check`` decodes once (the compiled engine compiles here) and answers the tokens' sha256 and steps, ``round``
decodes once and answers its wall and process CPU seconds.

    python bench/backbone_worker.py --tree DIR --model testbed --batch 1 --items 8 [--compiled]
"""

import argparse
import hashlib
import json
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tree", required=True, help="source tree whose tracelock is imported")
    parser.add_argument("--model", default="testbed", help="a bundled model (testbed, testbed-dream)")
    parser.add_argument("--batch", type=int, default=1, help="prompts per fused_generate call (1: one at a time)")
    parser.add_argument("--items", type=int, default=8, help="held-out math prompts decoded per round")
    parser.add_argument("--compiled", action="store_true", help="the compiled engine (default: the eager loop)")
    args = parser.parse_args()
    sys.path.insert(0, args.tree)
    import torch

    import tracelock
    from tracelock.testbed import held_out

    torch.set_num_threads(1)
    tok = tracelock.load_tokenizer(args.model)
    prompts = [tok(e.prompt, add_special_tokens=False)["input_ids"] for e in held_out("math", "test", args.items)]
    model = tracelock.load_model(args.model)
    settings = dict(policy="threshold", policy_args={"tau": 0.9}, cache="dual", gen_length=64, block=16,
                    compile=args.compiled)
    chunks = [prompts[i:i + args.batch] for i in range(0, len(prompts), args.batch)]

    def decode():
        return [tracelock.fused_generate(model, chunk, **settings) for chunk in chunks]

    print(json.dumps(dict(ready=True, tracelock=tracelock.__file__)), flush=True)
    for line in sys.stdin:
        wall, cpu = time.perf_counter(), time.process_time()
        out = decode()
        answer = dict(seconds=time.perf_counter() - wall, cpu_seconds=time.process_time() - cpu)
        if line.strip() == "check":
            digest = hashlib.sha256()
            for tokens, _ in out:
                digest.update(tokens.cpu().numpy().tobytes())
            answer.update(sha256=digest.hexdigest(), steps=[s for _, st in out for s in st.steps])
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
