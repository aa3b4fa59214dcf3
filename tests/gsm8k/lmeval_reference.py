"""Score canned replies with lm-eval's own gsm8k task, for the parity test.

Run with the python of a venv that has lm-eval (not the suite's):

    python lmeval_reference.py DATA_DIR REPLIES.json OUT.json LIMIT

lm-eval's real `gsm8k.yaml` is used through its own `include:` mechanism; the
derived task changes only where the documents come from (the local
train.jsonl/test.jsonl through `datasets`' json loader instead of the hub).
`simple_evaluate` then runs as `lm_eval --tasks gsm8k --limit LIMIT
--log_samples` would, with its default seeds, except that the model is a
replay: it answers each prompt with the reply REPLIES.json holds for that
prompt's last question (a server cannot give chosen replies). Everything else
(few-shot sampling, prompt rendering, stop strings, filters, exact_match) is
lm-eval's code. OUT.json gets, per document, the prompt, the generation
kwargs, the reply and per filter the extracted string and exact_match.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import sys
import tempfile
from pathlib import Path


def main(data_dir: str, replies_path: str, out_path: str, limit: str) -> None:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import lm_eval
    import lm_eval.evaluator
    from lm_eval.api.model import LM

    replies = json.loads(Path(replies_path).read_text())
    yaml_path = Path(lm_eval.__file__).parent / "tasks" / "gsm8k" / "gsm8k.yaml"
    data = Path(data_dir).resolve()
    work = Path(tempfile.mkdtemp(prefix="lmeval-ref-"))
    task_yaml = work / "gsm8k_local.yaml"
    task_yaml.write_text(json.dumps({  # JSON is YAML
        "include": str(yaml_path), "task": "gsm8k_local", "dataset_path": "json", "dataset_name": None,
        "dataset_kwargs": {"data_files": {"train": str(data / "train.jsonl"),
                                          "test": str(data / "test.jsonl")}}}))

    class Replay(LM):
        def __init__(self):
            super().__init__()
            self.requests = []

        def generate_until(self, requests, disable_tqdm: bool = False):
            out = []
            for request in requests:
                context, gen_kwargs = request.args
                self.requests.append({"doc_id": request.doc_id, "gen_kwargs": gen_kwargs})
                question = context.rsplit("Question: ", 1)[1].rsplit("\nAnswer:", 1)[0]
                out.append(replies[question])
            return out

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            raise NotImplementedError("gsm8k only generates")

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            raise NotImplementedError("gsm8k only generates")

    lm = Replay()
    os.environ["HF_DATASETS_CACHE"] = str(work / "hf-cache")
    results = lm_eval.evaluator.simple_evaluate(model=lm, tasks=[str(task_yaml)], limit=int(limit),
                                                log_samples=True, bootstrap_iters=0)
    samples = results["samples"]["gsm8k_local"]
    docs: dict[int, dict] = {}
    for s in samples:
        entry = docs.setdefault(s["doc_id"], {"doc_id": s["doc_id"], "question": s["doc"]["question"],
                                              "target": s["target"], "prompt": s["arguments"][0][0],
                                              "reply": s["resps"][0][0], "filters": {}})
        entry["filters"][s["filter"]] = {"extracted": s["filtered_resps"][0], "exact_match": s["exact_match"]}
    gen_kwargs = {json.dumps(r["gen_kwargs"], sort_keys=True) for r in lm.requests}
    out = {"lm_eval_version": importlib.metadata.version("lm-eval"),
           "task_version": results["configs"]["gsm8k_local"]["metadata"]["version"],
           "fewshot_seed": results["config"].get("fewshot_seed"),
           "num_fewshot": results["n-shot"]["gsm8k_local"],
           "gen_kwargs": [json.loads(g) for g in sorted(gen_kwargs)],
           "results": {k: v for k, v in results["results"]["gsm8k_local"].items() if "stderr" not in k},
           "docs": [docs[k] for k in sorted(docs)]}
    Path(out_path).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:])
