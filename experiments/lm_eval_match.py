"""lm-evaluation-harness as kernjax's client: the same loglikelihoods as transformers.

Serves a float32 checkpoint cut into 2 stages (`kernjax serve`, host transport) and runs
`lm_eval --model local-completions` against it (tokenized requests with the checkpoint's
tokenizer: lm-eval sends token ids with `echo`, `logprobs` 1 and `max_tokens` 1), then
`lm_eval --model hf` on the same checkpoint, on two local tasks (`tests/lm_eval/`: a
multiple-choice task and a greedy `generate_until` one; no network). Compares, sample by sample,
the loglikelihood of every choice (within `--rtol` relative), the `is_greedy` flags, the
accuracy, and the generated text, and writes `results.json` and `README.md` into `--out`.

lm-eval and torch run in their own Python (`--lm_eval_python`; kernjax does not need them):

  python3.11 -m venv torchvenv && torchvenv/bin/pip install torch==2.13.0 transformers "lm_eval[hf,api]"
  python -m experiments.lm_eval_match --lm_eval_python torchvenv/bin/python --out OUT
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from experiments import harness

TASKS = Path(__file__).resolve().parent.parent / "tests" / "lm_eval"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kernjax(*args, **kw):
    return subprocess.run([sys.executable, "-m", "kernjax", *args], check=True, **kw)


def _tasks(into: Path) -> None:
    """The task YAMLs with their data files' absolute paths (lm-eval reads them from the cwd)."""
    into.mkdir(parents=True)
    for y in TASKS.glob("*.yaml"):
        text = y.read_text()
        for data in TASKS.glob("*.jsonl"):
            text = text.replace(f" {data.name}", f" {data}")
        (into / y.name).write_text(text)


def _samples(out: Path, task: str) -> list[dict]:
    files = sorted(out.rglob(f"samples_{task}_*.jsonl"))
    if not files:
        raise SystemExit(f"lm_eval wrote no samples for {task} under {out}")
    return [json.loads(x) for x in files[-1].read_text().splitlines() if x.strip()]


def _acc(out: Path, task: str, metric: str) -> float:
    files = sorted(out.rglob("results_*.json"))
    return json.loads(files[-1].read_text())["results"][task][f"{metric},none"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lm_eval_python", required=True, help="a Python with lm_eval and torch")
    ap.add_argument("--out", required=True, help="directory for results.json and README.md")
    ap.add_argument("--model", default="qwen3-tiny", help="a named model (random float32 weights)")
    ap.add_argument("--rtol", type=float, default=1e-4)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="lm-eval-"))
    procs = []
    try:
        ckpt, cut_dir, tasks = tmp / "ckpt", tmp / "cut", tmp / "tasks"
        _tasks(tasks)
        _kernjax("weights", "random", "--model", args.model, "--dtype", "float32", "--out",
                 str(ckpt))
        _kernjax("cut", "--weights", str(ckpt), "--at", "2", "--chunk", "64", "--seqs", "8",
                 "--context", "512", "--decode", "1,4,16", "--out", str(cut_dir),
                 stdout=subprocess.DEVNULL)
        port, pp = _port(), _port()
        logs = tmp / "logs"
        procs.append(subprocess.Popen([sys.executable, "-m", "kernjax", "serve", "--stage_dir",
                                       str(cut_dir / "stage0"), "--pp_listen", f"127.0.0.1:{pp}",
                                       "--port", str(port), "--log_dir", str(logs)],
                                      stderr=subprocess.DEVNULL))
        procs.append(subprocess.Popen([sys.executable, "-m", "kernjax", "serve", "--stage_dir",
                                       str(cut_dir / "stage1"), "--pp_head", f"127.0.0.1:{pp}",
                                       "--log_dir", str(logs)], stderr=subprocess.DEVNULL))
        url = f"http://127.0.0.1:{port}"
        if not harness.healthy(url, 300):
            raise SystemExit("the 2-stage server did not start")
        env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false"}
        common = ["--tasks", "kernjax_mc,kernjax_gen", "--include_path", str(tasks),
                  "--log_samples", "--batch_size", "4", "--seed", "0"]
        runs = {
            "kernjax": ["--model", "local-completions", "--model_args",
                        f"model={args.model},base_url={url}/v1/completions,tokenizer_backend="
                        f"huggingface,tokenizer={ckpt},tokenized_requests=True,num_concurrent=1,"
                        "max_retries=1,timeout=600"],
            "hf": ["--model", "hf", "--model_args", f"pretrained={ckpt},dtype=float32,"
                   "attn_implementation=eager", "--device", "cpu"]}
        seconds = {}
        for name, margs in runs.items():
            t0 = time.time()
            subprocess.run([args.lm_eval_python, "-m", "lm_eval", *margs, *common,
                            "--output_path", str(tmp / name)], check=True, env=env,
                           cwd=tmp, stdout=subprocess.DEVNULL)
            seconds[name] = round(time.time() - t0, 1)
        rec = compare(tmp, args.rtol)
        rec.update(seconds=seconds, model=args.model, machine=platform.platform(),
                   date=time.strftime("%Y-%m-%d"), python=sys.version.split()[0],
                   lm_eval=subprocess.run([args.lm_eval_python, "-c", "import lm_eval, torch, "
                                           "transformers; print(lm_eval.__version__, "
                                           "torch.__version__, transformers.__version__)"],
                                          capture_output=True, text=True).stdout.split())
        (out / "results.json").write_text(json.dumps(rec, indent=1) + "\n")
        print(json.dumps({k: v for k, v in rec.items() if k != "samples"}, indent=1))
        if not rec["pass"]:
            raise SystemExit("FAIL: kernjax and transformers disagree (results.json)")
        print("PASS: lm-eval through the 2-stage server equals lm-eval on transformers")
    finally:
        for p in procs:
            p.kill()
            p.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def compare(tmp: Path, rtol: float) -> dict:
    """Per sample and choice: kernjax's and transformers' loglikelihoods and is_greedy, and the
    generated texts; the worst relative difference and whether every check holds."""
    ours, theirs = _samples(tmp / "kernjax", "kernjax_mc"), _samples(tmp / "hf", "kernjax_mc")
    by = {s["doc_id"]: s for s in theirs}
    worst, greedy_same, rows = 0.0, True, []
    for s in sorted(ours, key=lambda s: s["doc_id"]):
        t = by[s["doc_id"]]
        for (a, ga), (b, gb) in zip((r[0] for r in s["resps"]), (r[0] for r in t["resps"]),
                                    strict=True):
            rel = abs(float(a) - float(b)) / max(abs(float(b)), 1e-30)
            worst = max(worst, rel)
            greedy_same &= bool(ga) == bool(gb)
            rows.append({"doc": s["doc_id"], "kernjax": float(a), "hf": float(b),
                         "rel": rel, "greedy": [bool(ga), bool(gb)]})
    acc = {n: _acc(tmp / n, "kernjax_mc", "acc") for n in ("kernjax", "hf")}
    gen_ours = {s["doc_id"]: s["resps"][0][0] for s in _samples(tmp / "kernjax", "kernjax_gen")}
    gen_theirs = {s["doc_id"]: s["resps"][0][0] for s in _samples(tmp / "hf", "kernjax_gen")}
    same_text = gen_ours == gen_theirs
    return {"pass": worst <= rtol and greedy_same and acc["kernjax"] == acc["hf"] and same_text,
            "choices": len(rows), "worst_relative": worst, "rtol": rtol,
            "is_greedy_same": greedy_same, "acc": acc, "generate_until_same": same_text,
            "generated": {"kernjax": gen_ours, "hf": gen_theirs}, "samples": rows}


if __name__ == "__main__":
    main()
