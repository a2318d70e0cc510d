"""How far does a last-bit perturbation of the input move a model's next-token logprobs,
with and without bitsandbytes 8-bit weights?  (Is the all-selected oracle gap on random
bnb8 checkpoints relay's, or the method's sensitivity?)

    python research/studies/bnb8_sensitivity.py OUT_DIR [EPS] [every-layer]

For each model (the embedded SmolLM2 and a random-weight Llama, each fp32 and bnb 8-bit
with threshold 0), Hugging Face forwards a prompt twice: as is, and with its input
embeddings scaled by (1 + EPS * noise) -- the size of the last-bit differences between
two attention kernels (``every-layer``: every decoder layer's input, as two kernels' last
bits differ in every layer). Prints max |delta logprob| at the last position over the vocabulary,
the first token's delta, and the greedy 6-token continuations. Findings: research/log.md."""

import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from sglang_relay.bench.models import random_model
from sglang_relay.embedded_model import default_model_dir

out = Path(sys.argv[1])
EPS = float(sys.argv[2]) if len(sys.argv) > 2 else 1e-6
EVERY_LAYER = len(sys.argv) > 3 and sys.argv[3] == "every-layer"


def load(path: Path, bnb: bool):
    kw = {"torch_dtype": torch.float32}
    if bnb:
        kw["quantization_config"] = BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=0.0)
    return AutoModelForCausalLM.from_pretrained(path, **kw).eval()


@torch.no_grad()
def greedy(model, embeds, n=6):
    toks, past, x = [], None, embeds
    for _ in range(n):
        o = model(inputs_embeds=x, past_key_values=past, use_cache=True)
        past = o.past_key_values
        lp = torch.log_softmax(o.logits[0, -1].float(), -1)
        t = int(lp.argmax())
        toks.append(t)
        if len(toks) == 1:
            first = lp
        x = model.get_input_embeddings()(torch.tensor([[t]])).to(embeds.dtype)
    return toks, first


def run(name, path, bnb):
    model = load(path, bnb)
    ids = torch.tensor([[*range(4000, 4017), *range(1048, 1112), *range(3000, 3011)]])
    emb = model.get_input_embeddings()(ids).float()
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(emb.shape, generator=g)
    base_t, base_lp = greedy(model, emb)
    if EVERY_LAYER:  # every decoder layer's input, as a kernel's last bits would be

        def nudge(_mod, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            h = h * (1 + EPS * torch.randn(h.shape, generator=g))
            return ((h, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": h})

        hooks = [m.register_forward_pre_hook(nudge, with_kwargs=True) for m in model.model.layers]
        pert_t, pert_lp = greedy(model, emb)
        for h in hooks:
            h.remove()
    else:
        pert_t, pert_lp = greedy(model, emb * (1 + EPS * noise))
    d = (base_lp - pert_lp).abs()
    top = int(base_lp.argmax())
    where = " every layer" if EVERY_LAYER else ""
    same = "SAME" if base_t == pert_t else "DIFFER"
    print(
        f"{name:22s} eps {EPS:g}{where}: max|dlogprob| {d.max():.2e}  first-token dlogprob "
        f"{d[top]:.2e}  greedy {base_t} vs {pert_t}  {same}",
        flush=True,
    )


emb_dir = default_model_dir()
rl = random_model("llama", out / "random-llama", emb_dir)
run("embedded fp32", emb_dir, False)
run("embedded bnb8", emb_dir, True)
run("random llama fp32", rl, False)
run("random llama bnb8", rl, True)
