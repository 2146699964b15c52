"""Run under an interpreter that has lm-eval: one small multiple-choice task through
lm-eval's ``local-completions`` (our server) and its ``hf`` backend (the same weights,
float32); prints both backends' per-sample loglikelihoods and accuracy as JSON.

    python compare.py BASE_URL MODEL_FOLDER
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

QUESTIONS = [
    ("What color is the sky on a clear day?", ["blue", "green", "red", "black"], 0),
    ("How many legs does a spider have?", ["six", "eight", "ten", "four"], 1),
    ("What is the capital of France?", ["Berlin", "Madrid", "Paris", "Rome"], 2),
    ("Which animal barks?", ["cat", "cow", "fish", "dog"], 3),
    ("What is 2 + 2?", ["4", "5", "3", "22"], 0),
    ("Water freezes at what temperature in Celsius?", ["100", "0", "50", "-40"], 1),
    ("Which planet do we live on?", ["Mars", "Venus", "Earth", "Jupiter"], 2),
    ("What do bees make?", ["milk", "silk", "wool", "honey"], 3),
    ("Which is a fruit?", ["apple", "carrot", "potato", "onion"], 0),
    ("What is the opposite of hot?", ["warm", "cold", "wet", "loud"], 1),
    ("How many days are in a week?", ["five", "six", "seven", "eight"], 2),
    ("Which season is the coldest?", ["summer", "spring", "autumn", "winter"], 3),
    ("What do you use to write on paper?", ["pen", "spoon", "shoe", "cup"], 0),
    ("Which is the largest ocean?", ["Arctic", "Pacific", "Indian", "Atlantic"], 1),
    ("What gas do plants take in?", ["oxygen", "helium", "carbon dioxide", "neon"], 2),
    ("Which is a primary color?", ["pink", "brown", "grey", "yellow"], 3),
    ("What is frozen water called?", ["ice", "steam", "sand", "glass"], 0),
    ("Which shape has three sides?", ["square", "triangle", "circle", "hexagon"], 1),
    ("What is the sun?", ["a planet", "a moon", "a star", "a comet"], 2),
    ("Which month comes after January?", ["March", "April", "May", "February"], 3),
]

TASK = """task: async_engine_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""


def main() -> None:
    import lm_eval
    from lm_eval.tasks import TaskManager

    base_url, folder = sys.argv[1], sys.argv[2]
    tmp = Path(tempfile.mkdtemp())
    data = tmp / "questions.jsonl"
    data.write_text(
        "".join(
            json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS
        )
    )
    (tmp / "task.yaml").write_text(TASK.format(data=data))
    tasks = TaskManager(include_path=str(tmp))
    runs = {
        "local-completions": (
            f"model=default,base_url={base_url},tokenizer_backend=huggingface,"
            f"tokenizer={folder},tokenized_requests=True,num_concurrent=1,max_retries=1"
        ),
        "hf": f"pretrained={folder},dtype=float32,device=cpu",
    }
    out = {}
    for backend, args in runs.items():
        result = lm_eval.simple_evaluate(
            model=backend, model_args=args, tasks=["async_engine_mc"], task_manager=tasks,
            log_samples=True, batch_size=1,
        )  # fmt: skip
        samples = result["samples"]["async_engine_mc"]
        out[backend] = {
            "acc": result["results"]["async_engine_mc"]["acc,none"],
            "loglikelihoods": [
                [float(r[0]) for r in sorted_resps]
                for sorted_resps in (
                    [resp[0] for resp in s["resps"]]
                    for s in sorted(samples, key=lambda s: s["doc_id"])
                )
            ],
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
