"""Sample text from a model trained by ``examples/pretrain_llama.py``: from its ``--out``
directory (the newest complete checkpoint), from one checkpoint, or from a Hugging Face export.

    python examples/generate.py runs/default                          # newest checkpoint of the run
    python examples/generate.py runs/default/checkpoints/step_00000300 --prompt "O Romeo" --tokens 300
    python examples/generate.py runs/default/hf --temperature 0       # an --export-hf folder; greedy
    python examples/generate.py runs/default --temperature 0.8 --top-k 40 --seed 1 --json

Plain ``python`` (one process, CPU unless ``--device cuda``). A checkpoint is read with the job's
own settings (``run.json`` in ``--out``: preset, tokenizer, sequence length), its shards are put
together once through ``yafsdp`` (a world of one: any number of ranks may have written it) and the
model runs as a plain HF ``LlamaForCausalLM``. An export is read with ``from_pretrained`` and the
tokenizer saved next to it. The text goes to stdout (``--json``: prompt, ids and text), what was
loaded to stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


class GenerateError(RuntimeError):
    """A source that cannot be read; printed without a traceback, exit status 2."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Sample from a pretrain_llama.py run, checkpoint or HF export.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("source", help="a run's --out directory, one of its checkpoints/step_N, or an --export-hf folder")
    p.add_argument("--prompt", default="We the People", help="text the sample continues")
    p.add_argument("--tokens", type=int, default=200, help="tokens to sample (stops early at the tokenizer's EOS)")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0: greedy (argmax)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens only (0: all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the model runs")
    p.add_argument("--json", action="store_true", help="print a JSON object (prompt, ids, text) instead of the text")
    a = p.parse_args(argv)
    if a.tokens < 0 or a.temperature < 0 or a.top_k < 0:
        p.error(f"--tokens, --temperature and --top-k must be >= 0, got {a.tokens}, {a.temperature}, {a.top_k}")
    return a


def load_export(path: str):
    """(model, tokenizer) from an --export-hf folder."""
    from transformers import LlamaForCausalLM

    from pretrain import data as D

    if not any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        raise GenerateError(f"{path!r} holds a model but no tokenizer (tokenizer.json); export with "
                            "pretrain_llama.py --export-hf, or copy the tokenizer files into it")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model, D.HFTokenizer(path), f"HF export {path}"


def load_checkpoint(path: str, run_dir: str):
    """(model, tokenizer) from a yafsdp checkpoint of the run in ``run_dir``."""
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    import pretrain_llama as J
    import yafsdp
    from pretrain import data as D
    from yafsdp import checkpoint as C
    from yafsdp.init import meta_parameters

    run_json = os.path.join(run_dir, "run.json")
    if not os.path.isfile(run_json):
        raise GenerateError(f"{run_json!r} is missing: a checkpoint is read with the settings of the run that "
                            "wrote it (preset, tokenizer); pass that run's --out, or export it with --export-only")
    with open(run_json) as f:
        saved = json.load(f)["args"]
    argv = ["--preset", saved["preset"], "--seq-len", str(saved["seq_len"]), "--attn", saved.get("attn", "sdpa")]
    if saved.get("tokenizer"):
        argv += ["--tokenizer", saved["tokenizer"]]
    if saved.get("init_from_hf"):
        argv += ["--init-from-hf", saved["init_from_hf"]]
    args = J.parse_args(argv)
    try:
        tokenizer = D.make_tokenizer(args.tokenizer)
        shape, cfg = J.model_config(args, tokenizer)
        ckpt_shape = C.read_manifest(path).get("meta", {}).get("model_shape")
    except (D.DataError, J.JobError, C.CheckpointError) as e:
        raise GenerateError(str(e)) from None
    if ckpt_shape is not None and ckpt_shape != shape:
        raise GenerateError(f"checkpoint {path!r} does not match {run_json!r}: {ckpt_shape} vs {shape}")
    own_group = not dist.is_initialized()
    if own_group:  # a world of one in this process: the engine puts the shards together
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with meta_parameters():
            sharded = yafsdp.YaFSDP(LlamaForCausalLM(cfg), device=torch.device("cpu"))
        try:
            C.load_checkpoint(path, sharded)  # checks every file's size and CRC-32 first
        except C.CheckpointError as e:
            raise GenerateError(str(e)) from None
        state = sharded.full_state_dict()
    finally:
        if own_group:
            dist.destroy_process_group()
    model = LlamaForCausalLM(cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = getattr(model, "_tied_weights_keys", None) or ()
    if unexpected or [k for k in missing if k not in tied]:
        raise GenerateError(f"checkpoint {path!r}: {len(missing)} missing, {len(unexpected)} unexpected keys")
    model.tie_weights()
    return model, tokenizer, f"checkpoint {path} ({shape['num_hidden_layers']} layers x {shape['hidden_size']})"


def load(source: str):
    """(model, tokenizer, description) for a run directory, a checkpoint or an HF export."""
    from yafsdp import checkpoint as C

    if not os.path.isdir(source):
        raise GenerateError(f"{source!r}: no such directory (expected a run's --out, a checkpoint or an HF export)")
    if os.path.isfile(os.path.join(source, "config.json")):
        return load_export(source)
    if os.path.isfile(os.path.join(source, "checkpoint.json")):
        return load_checkpoint(source, os.path.dirname(os.path.dirname(os.path.abspath(source))))
    ck_root = os.path.join(source, "checkpoints")
    complete = C.list_checkpoints(ck_root) if os.path.isdir(ck_root) else []
    if complete:
        return load_checkpoint(complete[-1][1], source)
    raise GenerateError(f"{source!r} is neither an HF export (config.json), a checkpoint (checkpoint.json) nor a "
                        f"run directory with a complete checkpoint in {ck_root!r}")


@torch.no_grad()
def sample(model, prompt_ids: list[int], n: int, temperature: float, top_k: int, seed: int, eos_id, device) -> list[int]:
    """``n`` tokens after ``prompt_ids``; the context is cropped to the model's positions (nanoGPT's
    habit), with the KV cache used while the whole sequence fits."""
    ctx = int(model.config.max_position_embeddings)
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    g = torch.Generator(device="cpu").manual_seed(seed)
    past, out = None, []
    for _ in range(n):
        length = ids.shape[1]
        if past is not None and length <= ctx:
            res = model(input_ids=ids[:, -1:], past_key_values=past, use_cache=True)
            past = res.past_key_values
        else:
            res = model(input_ids=ids[:, -ctx:], use_cache=length < ctx)
            past = res.past_key_values if length < ctx else None
        logits = res.logits[0, -1].float().cpu()
        if temperature == 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if 0 < top_k < logits.numel():
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=g))
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]], device=device)], dim=1)
        if eos_id is not None and nxt == eos_id:
            break
    return out


def main(argv=None) -> int:
    a = parse_args(argv)
    try:
        model, tok, what = load(a.source)
    except GenerateError as e:
        print(f"generate.py: error: {e}", file=sys.stderr)
        return 2
    device = torch.device(a.device)
    model.to(device).eval()
    prompt = [int(i) for i in tok.encode(a.prompt)]
    if not prompt and tok.bos_id is not None:
        prompt = [int(tok.bos_id)]
    print(f"generate.py: {what}; {sum(p.numel() for p in model.parameters()):,} parameters; temperature "
          f"{a.temperature:g}, top-k {a.top_k or 'off'}, seed {a.seed}", file=sys.stderr)
    ids = sample(model, prompt, a.tokens, a.temperature, a.top_k, a.seed, tok.eos_id, device)
    text = a.prompt + tok.decode(ids)
    if a.json:
        print(json.dumps(dict(prompt=a.prompt, ids=ids, text=text)))
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from pretrain.ops import exit_fast

    exit_fast(main())  # sys.exit(main()), without the collector's pass over every object at exit
