"""Quest's unread pages as one token each (SparsitySpec.unread_means).

Quest reads a budget of pages and skips the rest, so the attention mass of every skipped page is lost and
the softmax renormalises over what was read. With `unread_means`, each skipped page still takes part as
one token that stands for its P keys and values: its key is the centre of the page's key box (the min / max
summaries Quest keeps anyway), its value the mean of the page's values (kept per page in bfloat16, from the
full-precision values as the page completes), and its logit gets + log P, so it weighs like P tokens at the
centre's logit. The pages a step reads are attended exactly as before.

exp(q.centre) under-counts a page whose keys spread along q (Jensen), and the mean value ignores how the
page's own tokens would share its weight; both errors are confined to pages the estimate ranked low.
SmolLM2-135M, `quest-25` (pages of 4, a quarter of the context read), 4 windows of 1024 tokens of eval.txt:
+1.745 % perplexity and KL 1.02e-2 skipping the pages, +0.088 % and 6.37e-3 with their means (calib.txt:
+0.935 % and 8.30e-3, +0.120 % and 4.89e-3). Adding the box's variance to the logit
(1/2 sum_i (s q_i)^2 half_width_i^2 / 3) over-counts: +2.31 %. The exact log-sum-exp of a page's logits
with the mean value gave +1.10 % on the first window (-0.56 % with the centre): a page's mass without
where it goes within the page does not help.

Pages that hold padding in any slot are skipped as before (their means would mix padding in), so a padded
row whose padding is whole pages attends as it would alone. The fused kernel does not read the page means:
a layer with `unread_means` decodes through the torch attention (kvcompress.kernels.attention_backend).
"""

from __future__ import annotations

import math

import torch


def unread_tokens(state, step) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """One stand-in token per summarised page the step's selection skipped.

    state: the layer's SparseState (page_min / page_max [B, H, P, D] bfloat16, page_means [B, H, P, Dv]);
    step: its StepInputs of a decode step (index [B, H, n] the held tokens read, -1 reading nothing;
    mask [B, H, 1, held]). Returns keys [B, H, P, D], values [B, H, P, Dv] (float32) and a logit bias
    [B, H, P]: log(page size) for a skipped page of real tokens, -inf for a page read or holding padding.
    None when the step read everything.
    """
    if step.index is None or state.page_means is None:
        return None
    p = state.policy.page_size
    b, h, n_pages = state.page_means.shape[:3]
    read = torch.zeros(b, h, n_pages + 1, dtype=torch.bool, device=step.index.device)
    page = torch.where(step.index >= 0, step.index // p, n_pages).clamp_max(n_pages)
    read.scatter_(2, page, True)  # index -1 and tokens past the summarised pages land in the spare slot
    real = step.mask[:, :, -1, : n_pages * p].reshape(b, h, n_pages, p).all(-1)
    skipped = real & ~read[..., :n_pages]
    centre = (state.page_min.float() + state.page_max.float()) / 2
    bias = torch.where(skipped, math.log(p), float("-inf"))
    return centre, state.page_means.float(), bias
