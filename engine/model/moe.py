"""DeepSeek's mixture-of-experts MLP: a router picks top-k of the routed experts per token, the
chosen experts' outputs are summed with the router's weights, and the shared experts (one gated
MLP of n_shared x moe_intermediate_size) see every token.

Routing, in float32 as DeepSeek and transformers compute it:
    V2  softmax scores; top-k over all experts ("greedy"), or over the top_k_group groups with
        the highest per-group maximum ("group_limited_greedy")
    V3  sigmoid scores; experts are *chosen* on score + e_score_correction_bias (the
        auxiliary-loss-free balancing bias), within the topk_group groups whose two best biased
        scores sum highest ("noaux_tc"); the *weights* are the unbiased scores of the chosen
    then optionally normalised to sum 1 (norm_topk_prob), times routed_scaling_factor.

The experts run over the tokens routed to them: the (token, expert) pairs are sorted by expert
and each expert with any token runs once on its rows, one matmul per projection, not a loop
over tokens.
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.engine.model.deepseek_config import DeepseekConfig
from kvserve.engine.model.gated_mlp import GatedMLP


class Router(nn.Module):
    def __init__(self, config: DeepseekConfig) -> None:
        super().__init__()
        self.top_k, self.num_experts = config.num_experts_per_tok, config.n_routed_experts
        self.scoring, self.method = config.scoring_func, config.topk_method
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.normalise, self.scaling = config.norm_topk_prob, config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size))
        if self.method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(self.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (expert ids [T, k], weights [T, k] float32)."""
        logits = torch.nn.functional.linear(x.float(), self.weight.float())
        scores = logits.sigmoid() if self.scoring == "sigmoid" else logits.softmax(dim=-1)
        if self.method == "noaux_tc":
            choice = scores + self.e_score_correction_bias.float()
            group_scores = choice.view(-1, self.n_group, self.num_experts // self.n_group).topk(2, dim=-1)[0].sum(dim=-1)
            ids = self._top_k(self._keep_groups(choice, group_scores, float("-inf")))
            weights = scores.gather(1, ids)
        else:
            if self.method == "group_limited_greedy":
                group_scores = scores.view(-1, self.n_group, self.num_experts // self.n_group).max(dim=-1).values
                scores = self._keep_groups(scores, group_scores, 0.0)
            ids = self._top_k(scores)
            weights = scores.gather(1, ids)
        if self.normalise and self.top_k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * self.scaling

    def _keep_groups(self, scores: torch.Tensor, group_scores: torch.Tensor, fill: float) -> torch.Tensor:
        chosen = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
        keep = keep.repeat_interleave(self.num_experts // self.n_group, dim=1)
        return scores.masked_fill(~keep, fill)

    def _top_k(self, scores: torch.Tensor) -> torch.Tensor:
        return scores.topk(self.top_k, dim=-1, sorted=False)[1]


class MoE(nn.Module):
    def __init__(self, config: DeepseekConfig) -> None:
        super().__init__()
        self.gate = Router(config)
        self.experts = nn.ModuleList(GatedMLP(config.hidden_size, config.moe_intermediate_size)
                                     for _ in range(config.n_routed_experts))
        self.shared_experts = (GatedMLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)
                               if config.n_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)
        out = torch.zeros_like(x)
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        rows = order // ids.shape[1]  # the token of each (token, expert) pair, grouped by expert
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        pair_weights = weights.flatten()[order].to(x.dtype).unsqueeze(1)
        start = 0
        for expert, count in zip(self.experts, counts):
            if count:
                chosen = rows[start:start + count]
                out.index_add_(0, chosen, expert(x[chosen]) * pair_weights[start:start + count])
                start += count
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
