"""How far Quest's page estimate is from the best page choice: a Quest preset against the same preset
whose pages are ranked by their true attention mass (the oracle), and the uncompressed cache, in one run.

The oracle replaces `page_scores` (the estimate from each page's key min / max) by the softmax attention
of the step's query over every held key, summed per page and over the GQA group: the pages a perfect
estimate would pick for this step, read under the same budget, page size and budget sharing. It reads
the full keys, so it bounds what any page estimate can reach; it is not a cache to use.

    python benchmarks/quest_oracle.py [PRESET] [CONTEXT] [WINDOWS]    # default: quest-25 1024 4

Perplexity as `kvcompress eval` measures it (prefill half of each window of eval.txt, decode the rest
token by token); prints the per-window Δppl of the estimate and of the oracle against the uncompressed
cache of the same run.
"""
import sys

import torch

import kvcompress
import kvcompress.sparse.quest as quest
from kvcompress.evaluation.runner import evaluate

PRESET = sys.argv[1] if len(sys.argv) > 1 else "quest-25"
CONTEXT = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
WINDOWS = int(sys.argv[3]) if len(sys.argv) > 3 else 4

_keys = {}
_select, _page_scores = quest.QuestPolicy.select, quest.page_scores


def select_keeping_keys(self, state, query, mask):
    _keys["keys"], _keys["mask"], _keys["page"] = state.step.keys, mask[:, :, -1], self.page_size
    return _select(self, state, query, mask)


def true_page_mass(query, page_min, page_max, real, scaling, radius_scale=1.0):
    """query [B, H, G, D] -> [B, H, n] the attention mass of each candidate page (of n), -inf on padding."""
    keys, mask, p = _keys["keys"], _keys["mask"], _keys["page"]  # [B, H, held, D], [B, H, held]
    b, h, g, _ = query.shape
    n = page_min.shape[2]
    logits = torch.einsum("bhgd,bhnd->bhgn", query.float(), keys.float()) * scaling
    w = torch.softmax(logits.masked_fill(~mask[:, :, None], float("-inf")), -1)  # [B, H, G, held]
    mass = w[..., : n * p].reshape(b, h, g, n, p).sum((2, 4))
    return mass.masked_fill(~real, float("-inf"))


def run(model, tok, oracle: bool, uncompressed: bool) -> list[dict]:
    quest.QuestPolicy.select = select_keeping_keys if oracle else _select
    quest.page_scores = true_page_mass if oracle else _page_scores
    try:
        return evaluate(model, tok, presets=[PRESET], context=CONTEXT, windows=WINDOWS, passkey=False,
                        include_uncompressed=uncompressed, progress=False)
    finally:
        quest.QuestPolicy.select, quest.page_scores = _select, _page_scores


def main():
    torch.set_num_threads(1)
    model, tok = kvcompress.load_model("smollm2-135m")
    ref, estimate = run(model, tok, oracle=False, uncompressed=True)
    (oracle,) = run(model, tok, oracle=True, uncompressed=False)
    print(f"{PRESET}, {WINDOWS} windows of {CONTEXT} tokens of eval.txt; uncompressed ppl per window "
          + ", ".join(f"{p:.4f}" for p in ref["ppl_windows"]))
    print("| pages ranked by | Δppl per window | mean | tokens read per step |\n|---|---|---|---|")
    for name, row in (("the estimate (the preset)", estimate), ("true attention mass (oracle)", oracle)):
        d = [100 * (a / b - 1) for a, b in zip(row["ppl_windows"], ref["ppl_windows"])]
        print(f"| {name} | " + ", ".join(f"{x:+.3f} %" for x in d) + f" | {sum(d) / len(d):+.3f} % | "
              f"{row['tokens_read']:.0f} of {row['tokens_held']} |")


if __name__ == "__main__":
    main()
