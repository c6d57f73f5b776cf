"""The LoRA job's instruction and chat data from datasets (examples/pretrain/data.py,
[Note: instruction datasets]): columns found, the chat template used, the prompt masked, bad rows
named; one short job run on a parquet instruction set."""
from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pretrain import data as D
from pretrain import instructions as I

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tok"))
    D.ByteTokenizer().save_pretrained(path)
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(path)
    t.chat_template = TEMPLATE
    t.save_pretrained(path)
    return D.HFTokenizer(path)


def test_instruction_columns_and_chats(tmp_path, chat_tok):
    pq.write_table(pa.table({"prompt": ["say hi", "count"], "response": ["hi", "1 2 3"]}), str(tmp_path / "a.parquet"))
    rows = I.read_instruction_dataset(str(tmp_path / "a.parquet"), "train")
    assert rows == [("pair", "say hi", "hi"), ("pair", "count", "1 2 3")]
    arr, _ = I.encode_examples(rows, D.ByteTokenizer(), 64, "a")
    assert np.array_equal(arr[0], I.encode_instruction("say hi", "hi", D.ByteTokenizer(), 64))
    alpaca = tmp_path / "alpaca.jsonl"
    alpaca.write_text(json.dumps({"instruction": "add", "input": "1+1", "output": "2"}) + "\n")
    assert I.read_instruction_dataset(str(alpaca), "train") == [("pair", "add\n\n1+1", "2")]
    chat = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hey"}]
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": chat}) + "\n")
    rows = I.read_instruction_dataset(str(tmp_path / "chat.jsonl"), "train")
    arr, _ = I.encode_examples(rows, chat_tok, 64, "chat")
    ids, labels = arr[0]
    text = chat_tok.tok.decode(ids[ids != chat_tok.pad_id].tolist())
    assert text.startswith("<|user|>hello<eos><|assistant|>hey<eos>"), text
    kept = labels[labels != I.IGNORE]
    assert chat_tok.tok.decode(kept.tolist()) == "hey<eos>"  # only the response (and its EOS) is a target
    # without a chat template (bytes): the turns in PROMPT_TEMPLATE, the response the target
    arr, _ = I.encode_examples(rows, D.ByteTokenizer(), 64, "chat")
    assert np.array_equal(arr[0], I.encode_instruction("user: hello", "hey", D.ByteTokenizer(), 64))


def test_bad_instruction_rows(tmp_path):
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": ["x", "y"]}), str(tmp_path / "b.parquet"))
    with pytest.raises(D.DataError, match=r"b.parquet' row 0: no string columns 'prompt' and 'response'.*answer"):
        I.read_instruction_dataset(str(tmp_path / "b.parquet"), "train")
    bad = tmp_path / "c.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}]}) + "\n")
    with pytest.raises(D.DataError, match=r"c.jsonl' row 0: 'messages' must be"):
        I.read_instruction_dataset(str(bad), "train")
    pq.write_table(pa.table({"text": ["plain"]}), str(tmp_path / "t.parquet"))
    with pytest.raises(I.NotInstructions):
        I.read_instruction_dataset(str(tmp_path / "t.parquet"), "train")


def test_lora_job_on_a_parquet_instruction_set(tmp_path):
    """The job reads a parquet folder of prompt/response rows as instructions (the response's loss)."""
    import subprocess
    import sys

    from job_utils import ROOT, env

    folder = tmp_path / "pq"
    folder.mkdir()
    prompts = [f"spell {w}" for w in ("cat", "dog", "sun", "tree", "moon", "star", "leaf", "rock")]
    pq.write_table(pa.table({"prompt": prompts, "response": [p[6:][::-1] for p in prompts]}),
                   str(folder / "train-00000.parquet"))
    cmd = [sys.executable, os.path.join(ROOT, "examples", "finetune_lora.py"), "--preset", "tiny", "--base-steps", "2",
           "--steps", "2", "--batch-size", "2", "--seq-len", "48", "--no-progress", "--sample-tokens", "0",
           "--eval-batches", "1", "--data", str(folder), "--out", str(tmp_path / "run")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env())
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"--data {str(folder)!r}: 8 instruction examples; 7 train / 1 held out" in p.stdout, p.stdout[-3000:]
    assert "loss on response tokens only" in p.stdout
