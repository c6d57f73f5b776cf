"""Instruction and chat examples of the fine-tuning jobs: reading them (JSONL, or any ``datasets`` source),
masking the prompt in the labels, and their seeded, resumable order (``ExampleBatches``, the pretraining
job's [Note: batch order] with an example in a window's place)."""
from __future__ import annotations

import json
import os

import numpy as np
import torch

from pretrain.data import DEFAULT_ORDER, EMBEDDED_DIR, Batches, DataError, jsonl_objects


class NotInstructions(DataError):
    """An instruction reader was given plain text rows (the LoRA job then trains on every token)."""


# [Note: instruction template]
# An instruction example {"prompt": P, "response": R} becomes the token sequence
#     encode(PROMPT_TEMPLATE.format(prompt=P)) + encode(R) + [eos]
# i.e. "### Instruction:\n" P "\n\n### Response:\n" R <eos>. The labels are -100 (ignored) on the
# template and prompt tokens and on padding; the response and its <eos> are the only targets, so
# the loss is the response's. Sequences are cut to seq_len + 1 tokens and padded after the end
# with the tokenizer's pad id (its eos id if it has none); padding comes last, so causal attention
# needs no mask.
PROMPT_TEMPLATE = "### Instruction:\n{prompt}\n\n### Response:\n"
IGNORE = -100  # F.cross_entropy's default ignore_index
EMBEDDED_INSTRUCTIONS = os.path.join(EMBEDDED_DIR, "instructions.jsonl")


def is_instruction_jsonl(path: str | None) -> bool:
    """A ``.jsonl`` whose first record has string ``prompt`` and ``response`` fields."""
    if path is None or not path.endswith(".jsonl") or not os.path.isfile(path):
        return False
    obj = first_jsonl_record(path)
    return isinstance(obj, dict) and isinstance(obj.get("prompt"), str) and isinstance(obj.get("response"), str)


def first_jsonl_record(path: str):
    """The first non-blank line of a JSONL file, parsed (None if it is not JSON)."""
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                try:
                    return json.loads(line)
                except ValueError:
                    return None
    return None


def read_instructions(path: str) -> list[tuple[str, str]]:
    """(prompt, response) pairs of an instruction JSONL; DataError naming the file and line."""
    pairs = []
    for n, obj in jsonl_objects(path):
        if not isinstance(obj, dict) or not all(isinstance(obj.get(k), str) for k in ("prompt", "response")):
            raise DataError(f"--data {path!r}: line {n} needs string fields 'prompt' and 'response' "
                            "(an instruction file holds one {\"prompt\": ..., \"response\": ...} per line)")
        pairs.append((obj["prompt"], obj["response"]))
    if not pairs:
        raise DataError(f"--data {path!r}: no examples")
    return pairs


def encode_instruction(prompt: str, response: str, tokenizer, seq_len: int) -> np.ndarray:
    """One example as a (2, seq_len + 1) int64 array: row 0 the input ids, row 1 the labels
    (IGNORE except on the response and its eos). See [Note: instruction template]."""
    head = tokenizer.encode(PROMPT_TEMPLATE.format(prompt=prompt)).astype(np.int64)
    tail = tokenizer.encode(response).astype(np.int64)
    if tokenizer.eos_id is not None:
        tail = np.concatenate([tail, [tokenizer.eos_id]])
    return _padded(np.concatenate([head, tail]), np.concatenate([np.full(len(head), IGNORE), tail]), tokenizer, seq_len)


def _padded(ids: np.ndarray, labels: np.ndarray, tokenizer, seq_len: int) -> np.ndarray:
    """ids over labels, cut to ``seq_len + 1`` and padded after the end (pad id; IGNORE labels)."""
    ids, labels = ids[: seq_len + 1], labels[: seq_len + 1]
    pad = tokenizer.pad_id if tokenizer.pad_id is not None else (tokenizer.eos_id or 0)
    out = np.empty((2, seq_len + 1), dtype=np.int64)
    out[0], out[1] = pad, IGNORE
    out[0, : len(ids)], out[1, : len(labels)] = ids, labels
    return out


def encode_instructions(pairs, tokenizer, seq_len: int, source: str) -> tuple[np.ndarray, int]:
    """All examples, (N, 2, seq_len + 1), and how many had their response cut by ``seq_len``.
    DataError if an example keeps no response token (its prompt fills the sequence)."""
    arr = np.stack([encode_instruction(p, r, tokenizer, seq_len) for p, r in pairs])
    targets = (arr[:, 1, 1:] != IGNORE).sum(1)  # the loss's targets: labels from position 1 on
    empty = np.flatnonzero(targets == 0)
    if len(empty):
        n = int(empty[0])
        need = len(tokenizer.encode(PROMPT_TEMPLATE.format(prompt=pairs[n][0]))) + 1
        raise DataError(f"{source}: example {n + 1} leaves no response token within --seq-len {seq_len} (its "
                        f"templated prompt is {need - 1} tokens); raise --seq-len to at least {need} or shorten it")
    full = np.array([len(tokenizer.encode(PROMPT_TEMPLATE.format(prompt=p) + r)) + 1 for p, r in pairs])
    return arr, int((full > seq_len + 1).sum())


# [Note: instruction datasets]
# The LoRA job also reads instruction and chat data through ``datasets`` (``read_instruction_dataset``):
# a parquet/arrow/csv/jsonl file or folder, or a dataset name (``--data-split``). A row is
# - an instruction: ``--prompt-column``/``--response-column`` (default prompt/response; Alpaca's
#   instruction/input/output are found too, ``input`` appended to the instruction after a blank line);
# - a chat: a ``messages`` column, a list of {"role", "content"}, its last message the assistant's.
# With a tokenizer that has a chat template, an example is rendered by it: the prompt is the messages
# before the last with the generation prompt (``apply_chat_template(..., add_generation_prompt=True)``),
# the response the rest of the whole chat's rendering; otherwise (the byte tokenizer) the chat's
# turns are joined as "role: content" lines into PROMPT_TEMPLATE's prompt. Either way the labels
# are IGNORE on the prompt's tokens, as in [Note: instruction template]. The examples are read whole
# (instruction sets are small) and held out and ordered as the JSONL ones are.
def _row_example(row: dict, n: int, source: str, pcol: str, rcol: str):
    """A row as ("pair", prompt, response) or ("chat", messages); DataError naming the row."""
    if "messages" in row and row["messages"] is not None:
        msgs = row["messages"]
        ok = isinstance(msgs, list) and len(msgs) >= 2 and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs)
        if not ok or msgs[-1]["role"] != "assistant":
            raise DataError(f"{source} row {n}: 'messages' must be a list of {{role, content}} strings, at least two, "
                            "the last the assistant's")
        return ("chat", [{"role": m["role"], "content": m["content"]} for m in msgs])
    if pcol not in row and "instruction" in row and "output" in row:
        pcol, rcol = "instruction", "output"
    if not (isinstance(row.get(pcol), str) and isinstance(row.get(rcol), str)):
        if n == 0 and pcol not in row and rcol not in row:
            raise NotInstructions(f"{source}: its first row has none of the instruction or chat columns")
        raise DataError(f"{source} row {n}: no string columns {pcol!r} and {rcol!r} and no 'messages' (it has "
                        f"{', '.join(row)}); set --prompt-column/--response-column")
    prompt = row[pcol]
    if pcol == "instruction" and isinstance(row.get("input"), str) and row["input"]:
        prompt = f"{prompt}\n\n{row['input']}"
    return ("pair", prompt, row[rcol])


def read_instruction_dataset(data: str, split: str, pcol: str = "prompt", rcol: str = "response") -> list:
    """The examples of an instruction/chat dataset (see [Note: instruction datasets])."""
    import datasets

    from pretrain import stream as S

    if os.path.isdir(data):
        files = S.split_files(data, split)
        builder = S.TEXT_EXT[os.path.splitext(files[0])[1]]
        args, kw = (builder,), dict(data_files=files, split="train")
    elif os.path.isfile(data):
        ext = os.path.splitext(data)[1]
        if ext not in S.TEXT_EXT:
            raise DataError(f"--data {data!r}: not a .parquet/.arrow/.csv/.jsonl file")
        args, kw = (S.TEXT_EXT[ext],), dict(data_files=[data], split="train")
    else:
        args, kw = (data,), dict(split=split)
    try:
        ds = datasets.load_dataset(*args, **kw)
    except Exception as e:  # noqa: BLE001 - not found, corrupt, no network, bad split, ...
        raise DataError(f"--data {data!r}: datasets.load_dataset cannot read it ({type(e).__name__}: "
                        f"{str(e).splitlines()[0][:300]})") from None
    out = [_row_example(row, n, f"--data {data!r}", pcol, rcol) for n, row in enumerate(ds)]
    if not out:
        raise DataError(f"--data {data!r}: no examples")
    return out


def encode_chat(messages: list, tokenizer, seq_len: int) -> np.ndarray:
    """A chat as (2, seq_len + 1) ids and labels, the prompt masked (see [Note: instruction datasets])."""
    tok = getattr(tokenizer, "tok", None)
    if tok is None or not getattr(tok, "chat_template", None):
        prompt = "\n".join(f"{m['role']}: {m['content']}" for m in messages[:-1])
        return encode_instruction(prompt, messages[-1]["content"], tokenizer, seq_len)
    head = np.asarray(tok.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=True,
                                              return_dict=False), dtype=np.int64)
    full = np.asarray(tok.apply_chat_template(messages, tokenize=True, return_dict=False), dtype=np.int64)
    if len(full) <= len(head) or not np.array_equal(full[:len(head)], head):
        raise DataError("the tokenizer's chat template does not render the prompt as a prefix of the whole chat; "
                        "cannot tell the response's tokens")
    return _padded(full, np.concatenate([np.full(len(head), IGNORE), full[len(head):]]), tokenizer, seq_len)


def encode_examples(examples: list, tokenizer, seq_len: int, source: str) -> tuple[np.ndarray, int]:
    """``read_instruction_dataset``'s examples as ``encode_instructions`` gives them (chats through
    the chat template); DataError if one keeps no response token."""
    rows, cut = [], 0
    for n, ex in enumerate(examples):
        if ex[0] == "pair":
            arr, c = encode_instructions([(ex[1], ex[2])], tokenizer, seq_len, f"{source} row {n}")
            rows.append(arr[0])
            cut += c
            continue
        r = encode_chat(ex[1], tokenizer, seq_len)
        if (r[1, 1:] != IGNORE).sum() == 0:
            raise DataError(f"{source} row {n}: the chat leaves no response token within --seq-len {seq_len}; "
                            "raise --seq-len or shorten it")
        rows.append(r)
    return np.stack(rows), cut


class ExampleBatches(Batches):
    """Whole examples (N, 2, seq_len + 1) in the same seeded, epoch-wise order and cursor scheme as
    the windows of ``Batches`` (see [Note: batch order]): an example plays the part of a window."""

    def __init__(self, examples: np.ndarray, seed: int):
        self.examples = examples
        self.seq_len = examples.shape[-1] - 1
        self.seed = seed
        self.windows = len(examples)
        self.use_order(DEFAULT_ORDER)

    def window(self, w: int) -> np.ndarray:
        return self.examples[w]

    def in_order(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Examples ``first .. first + count - 1`` in file order, and a weight per row: rows past
        the end repeat example 0 with weight 0 (so every rank runs the same number of forwards)."""
        idx = [first + k for k in range(count)]
        rows = np.stack([self.examples[i if i < self.windows else 0] for i in idx])
        return torch.from_numpy(rows), torch.tensor([float(i < self.windows) for i in idx])
