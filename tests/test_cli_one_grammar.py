"""One grammar with no exceptions: no prefix matching, --settings and --gen-length/--block on every command that
decodes, --policies on frontier, --policy on demo, "did you mean" for a near miss, and every check before a model
loads (each case below fails in the parser, in the user's spelling)."""

import subprocess
import sys

import pytest

from tracelock.cli import build_parser, main

PARSER = build_parser()


@pytest.mark.parametrize(("argv", "says"), [
    # no prefix matching: serve's --gen-length is its own option, not --gen-lengths read as a prefix
    (["serve", "--model", "testbed", "--gen-lengt", "64"],
     "unrecognized arguments: --gen-lengt 64; did you mean '--gen-length'?"),
    (["generate", "--model", "testbed", "--prompt", "x", "--policy", "confidence", "--gen-len", "64"],
     "did you mean '--gen-length'"),
    (["demo", "--gen-length", "64", "--block", "15"], "--block 15 does not divide --gen-length 64"),
    (["demo", "--gen-length", "40"], "--block 16 does not divide --gen-length 40"),
    (["collect", "--model", "testbed", "--prompts", "testbed:math", "--out", "x", "--settings", "64/12"],
     "--settings 64/12: --block 12 does not divide --gen-length 64"),
    (["generate", "--model", "testbed", "--prompt", "x", "--policy", "confidence", "--gen-length", "64",
      "--temperature", "-1"], "argument --temperature: -1 must be a finite number >= 0"),
    (["generate", "--model", "testbed", "--prompt", "x", "--policy", "confidence", "--settings", "64/16,128/32"],
     "this command runs one setting"),
    (["generate", "--model", "testbed", "--prompt", "x", "--policy", "confidence"], "--gen-length (or --settings"),
    (["frontier", "--model", "testbed", "--tasks", "testbed:math", "--out", "x", "--policies", "thresold"],
     "did you mean 'threshold'"),
    (["frontier", "--model", "testbed", "--tasks", "testbed:math", "--out", "x"], "--sweep (or --policies"),
    (["serve", "--model", "testbed", "--settings", "64/16,128/32"], "one server runs one block width"),
    (["serve", "--model", "testbed", "--gen-length", "64", "--gen-lengths", "64,128"], "give the generation lengths"),
    # the names LLaDA's, Dream's and Fast-dLLM's users bring
    (["generate", "--model", "testbed", "--prompt", "x", "--policy", "confidence", "--gen-length", "64",
      "--block-length", "16"], "LLaDA's block_length is --block 16 here"),
    (["generate", "--model", "testbed", "--prompt", "x", "--policy", "confidence", "--max-new-tokens", "64"],
     "the generated length is --gen-length 64 here"),
    (["generate", "--model", "testbed", "--prompt", "x", "--policy", "confidence", "--gen-length", "64", "--steps",
      "32"], "--policy confidence:steps=32"),
    (["generate", "--model", "testbed", "--prompt", "x", "--gen-length", "64", "--remasking", "low_confidence"],
     "the rule is the policy here: --policy confidence"),
    (["eval", "--model", "testbed", "--tasks", "testbed:math", "--policies", "confidence", "--out", "o",
      "--threshold", "0.9"], "--policies threshold:tau=0.9"),
])
def test_mistakes_end_in_one_line_before_anything_loads(argv, says, capsys):
    with pytest.raises(SystemExit) as exit:
        PARSER.parse_args(argv)
    err = capsys.readouterr().err
    assert exit.value.code == 2 and says in err and err.count("\n") == 1, err


def test_each_decoding_command_takes_the_setting_both_ways():
    one = PARSER.parse_args(["generate", "--model", "testbed", "--prompt", "x", "--policy", "confidence",
                             "--settings", "64/16"])
    assert (one.gen_length, one.block, one.window) == (64, 16, None)
    window = PARSER.parse_args(["collect", "--model", "testbed", "--prompts", "testbed:math", "--out", "x",
                                "--settings", "32/8", "--window", "8"])
    assert (window.gen_length, window.block, window.window) == (32, None, 8)
    demo = PARSER.parse_args(["demo", "--settings", "32/8", "--policy", "credit"])
    assert (demo.gen_length, demo.block, demo.policies) == (32, 8, "credit")
    serve = PARSER.parse_args(["serve", "--model", "testbed", "--settings", "64/16,128/16"])
    assert (serve.gen_lengths, serve.block) == ("64,128", 16)
    assert PARSER.parse_args(["serve", "--model", "testbed", "--gen-length", "64"]).gen_lengths == "64"
    frontier = PARSER.parse_args(["frontier", "--model", "testbed", "--tasks", "testbed:math", "--out", "x",
                                  "--policies", "threshold:tau=0.7,0.9:hold_end=true,confidence",
                                  "--gen-length", "64", "--block", "16"])
    assert frontier.sweep == ["threshold:tau=0.7,0.9:hold_end=true", "confidence"] and frontier.settings == "64/16"
    rl = PARSER.parse_args(["rl", "--model", "testbed", "--controller", "c", "--prompts", "testbed:math", "--out", "o",
                            "--settings", "128/32"])
    assert (rl.gen_length, rl.window) == (128, 32)
    selftrain = PARSER.parse_args(["self-train", "--model", "testbed", "--controller", "c", "--cache", "k",
                                   "--prompts", "testbed:math", "--out", "o", "--settings", "128/32"])
    assert (selftrain.gen_length, selftrain.window, selftrain.block) == (128, 32, None)


@pytest.mark.parametrize("argv", [
    ["eval", "--model", "testbed", "--tasks", "testbed:math", "--policies", "threshold:ta=0.9", "--out", "RUN"],
    ["serve", "--model", "testbed", "--policies", "threshold:ta=0.9"],
])
def test_an_unknown_policy_argument_says_which_was_meant(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main([*argv, "--quiet"]) == 2
    assert "did you mean 'tau'?" in capsys.readouterr().err


def test_lm_eval_help_without_the_extra_says_the_install_command():
    blocked = ("import sys\n"
               "class Block:\n"
               "    def find_spec(self, name, path=None, target=None):\n"
               "        if name.split('.')[0] == 'lm_eval':\n"
               "            raise ImportError(name)\n"
               "sys.meta_path.insert(0, Block())\n"
               "from tracelock.cli import main\n"
               "sys.exit(main(['lm-eval', '--help']))\n")
    done = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert '-e ".[lm-eval]"' in done.stderr and "Traceback" not in done.stderr
