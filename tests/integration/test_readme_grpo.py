"""The README's reinforcement-learning chain runs as a user runs it (issue 42, item 6): SFT, GRPO from its
model with the README's own reward function (`rewards.py`, written from its code block), exported in
Hugging Face format, then served and asked a question over the OpenAI API. Each command is the README's
text, shortened to 2 steps, run from a folder that holds the repository's tests/ and train_configs/ (as
the repository's root does) and the user's rewards.py."""

from __future__ import annotations

import json
import os
import queue
import re
import shlex
import subprocess
import sys
import threading
import urllib.request

from conftest import REPO, _env

SECTION = "## Reinforcement learning (GRPO and its variants)"


def _section() -> str:
    return (REPO / "README.md").read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]


def _commands() -> list[tuple[dict, list[str]]]:
    """The section's commands as (environment variables, argv)."""
    block = _section().split("```bash\n", 1)[1].split("```", 1)[0]
    out = []
    for line in re.sub(r"\\\n\s*", "", block).splitlines():
        if line.startswith("#") or not line.strip():
            continue
        words = shlex.split(line)
        env = dict(w.split("=", 1) for w in words if re.fullmatch(r"[A-Z_]+=.*", w))
        out.append((env, words[len(env):]))
    return out


def _argv(words: list[str]) -> list[str]:
    """A README command on this interpreter, the repository's scripts by path, 2 steps."""
    assert words[0] == "python3", words
    argv = [sys.executable, str(REPO / words[1]), *words[2:]]
    argv = [a.replace("step-60", "step-2").replace("step-10", "step-2") for a in argv]
    if words[1] == "train.py":
        argv += ["--training.steps", "2", "--metrics.no_enable_tensorboard"]
    return argv


def test_readme_sft_grpo_export_serve(tmp_path):
    for name in ("tests", "train_configs"):
        (tmp_path / name).symlink_to(REPO / name)
    code = _section().split("```python\n", 1)[1].split("```", 1)[0]
    (tmp_path / "rewards.py").write_text(code)
    sft, grpo, serve = _commands()
    assert "PYTHONPATH" in grpo[0] and "rewards:exact_text" in grpo[1] and "--checkpoint.last_save_in_hf" in grpo[1]
    for variables, words in (sft, grpo):
        env = _env()
        for key, value in variables.items():  # PYTHONPATH=. : the user's folder, beside the repository
            env[key] = os.pathsep.join([str(tmp_path / value), env.get(key, "")])
        proc = subprocess.run(_argv(words), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    export = tmp_path / "outputs" / "grpo" / "checkpoint" / "step-2"
    assert (export / "config.json").is_file() and (export / "model.safetensors.index.json").is_file()
    records = [json.loads(line) for line in (tmp_path / "outputs" / "grpo" / "metrics.jsonl").open()]
    assert "reward/rewards:exact_text/mean" in records[0]

    argv = _argv(serve[1])
    argv[argv.index("--port") + 1] = "0"
    proc = subprocess.Popen(argv, cwd=tmp_path, env=_env(), stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()
    try:
        start = lines.get(timeout=180)
        assert " at http://127.0.0.1:" in start, start
        url = start.split(" at ")[1].split("/v1")[0]
        body = {"model": "step-2", "messages": [{"role": "user", "content": "reverse: red dog"}], "max_tokens": 4,
                "temperature": 0}
        request = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as r:
            answer = json.loads(r.read())
        assert answer["choices"][0]["message"]["role"] == "assistant"
    finally:
        proc.terminate()
        proc.wait(timeout=60)
