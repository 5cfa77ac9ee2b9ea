"""Published parameter counts of every family's released flavors, the figures the conformance suite
checks each flavor's args against (tests/conformance/test_family_conformance.py).

A new family adds its released flavors here; a flavor that names no released model (a debug model,
a size of our own) goes in UNPUBLISHED with the reason. Each figure keeps the precision its source
gives: an exact count, a rounded one (`digits` after the decimal point of `unit`), or a relative or
absolute margin.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Count:
    """A published count: exact, or within `rel` (relative) / `abs`, or equal once rounded to `digits`
    decimals of `unit` (as the sources print them, e.g. 8.2B)."""

    value: float
    rel: float | None = None
    abs: float | None = None
    digits: int | None = None
    unit: float = 1.0

    def holds(self, count: int) -> bool:
        if self.digits is not None:
            return round(count / self.unit, self.digits) == self.value
        if self.rel is not None:
            return abs(count - self.value) < self.rel * self.value
        if self.abs is not None:
            return abs(count - self.value) < self.abs
        return count == self.value


@dataclass(frozen=True)
class Published:
    total: Count
    active: Count | None = None  # parameters per token of a mixture of experts
    # Changes to the flavor's args before counting (what the source counts: DeepSeek-V3's 671B leaves
    # out its multi-token-prediction module, as transformers' model does).
    changes: dict = field(default_factory=dict)
    source: str = ""


def billions(value: float, digits: int = 1) -> Count:
    return Count(value, digits=digits, unit=1e9)


PUBLISHED: dict[tuple[str, str], Published] = {
    # Meta's model cards (totals with embeddings).
    ("llama3", "1B"): Published(Count(1.236e9, rel=0.01), source="Llama 3.2 1B"),
    ("llama3", "3B"): Published(Count(3.213e9, rel=0.01), source="Llama 3.2 3B"),
    ("llama3", "8B"): Published(Count(8.03e9, rel=0.01), source="Llama 3.1 8B"),
    ("llama3", "70B"): Published(Count(70.6e9, rel=0.01), source="Llama 3.1 70B"),
    ("llama3", "405B"): Published(Count(405.9e9, rel=0.01), source="Llama 3.1 405B"),
    # GPT-2 as transformers counts GPT2LMHeadModel (the tied lm_head once); GPT-3 175B.
    ("gpt2", "124M"): Published(Count(124_439_808), source="GPT-2 small"),
    ("gpt2", "355M"): Published(Count(354.8e6, abs=0.1e6), source="GPT-2 medium"),
    ("gpt2", "774M"): Published(Count(774.0e6, abs=0.1e6), source="GPT-2 large"),
    ("gpt2", "1.5B"): Published(Count(1557.6e6, abs=0.1e6), source="GPT-2 xl"),
    ("gpt2", "175B"): Published(Count(174.6e9, abs=0.05e9), source="GPT-3 175B"),
    # Qwen3's model cards.
    ("qwen3", "0.6B"): Published(billions(0.6)),
    ("qwen3", "1.7B"): Published(billions(1.7)),
    ("qwen3", "4B"): Published(billions(4.0)),
    ("qwen3", "8B"): Published(billions(8.2)),
    ("qwen3", "14B"): Published(billions(14.8)),
    ("qwen3", "32B"): Published(billions(32.8)),
    ("qwen3", "30B-A3B"): Published(billions(30.5), billions(3.4)),
    ("qwen3", "235B-A22B"): Published(billions(235.1), billions(22.2)),
    # Mistral's Mixtral releases (total, active).
    ("mixtral", "8x7B"): Published(billions(46.7), billions(12.9)),
    ("mixtral", "8x22B"): Published(billions(140.6), billions(39.2)),
    # DeepSeek-V3's report: 671B total, 37B activated (without the MTP module); Moonlight 16B-A3B.
    ("deepseek_v3", "671B"): Published(billions(671, digits=0), billions(37.6), changes={"mtp_num_layers": 0}),
    ("deepseek_v3", "16B"): Published(billions(16.0), billions(2.9)),
    # OpenAI's gpt-oss model card (Table 1: 20.91B and 116.83B total; 3.61B and 5.13B active, which leave
    # out the embedding table, 201088 x 2880 = 0.58B, that every active figure here counts).
    ("gpt_oss", "20B"): Published(billions(20.91, 2), Count(3.61e9 + 201088 * 2880, abs=0.005e9)),
    ("gpt_oss", "120B"): Published(billions(116.83, 2), Count(5.13e9 + 201088 * 2880, abs=0.005e9)),
    # NVIDIA's Nemotron-H and the Mamba-2 paper's 2.7B.
    ("hybrid", "nemotron_h_8b"): Published(Count(8.10e9, rel=2e-3)),
    ("hybrid", "nemotron_h_56b"): Published(Count(56.3e9, rel=2e-3)),
    ("hybrid", "mamba2_2.7b"): Published(Count(2.70e9, rel=2e-3)),
    # Qwen's model cards: "80B in total and 3B activated" (ours, 3.87B active, counts the embedding and
    # output tables, 0.62B, as every figure here does); Qwen3.5's text models (their names count the
    # vision tower too, not built here).
    ("qwen3_next", "80B-A3B"): Published(billions(80, 0), Count(3.0e9, rel=0.3)),
    ("qwen3_next", "3.5-9B"): Published(billions(9, 0)),
    ("qwen3_next", "3.5-27B"): Published(billions(27, 0)),
    ("qwen3_next", "3.5-35B-A3B"): Published(billions(35, 0), billions(3, 0)),
    # BERT's paper (base 110M, large 340M); Megatron-LM's 3.9B BERT.
    ("bert", "base"): Published(Count(110e6, rel=0.01)),
    ("bert", "large"): Published(Count(340e6, rel=0.02)),
    ("bert", "3.9B"): Published(Count(3.9e9, rel=0.01)),
    # google/t5-v1_1-*: 77M (small), 248M (base), 783M (large), 2.85B (xl), 11.1B (xxl).
    ("t5", "small"): Published(Count(76.96e6, rel=0.01)),
    ("t5", "base"): Published(Count(247.6e6, rel=0.01)),
    ("t5", "large"): Published(Count(783.2e6, rel=0.01)),
    ("t5", "3B"): Published(Count(2.85e9, rel=0.01)),
    ("t5", "11B"): Published(Count(11.14e9, rel=0.01)),
    # llava-hf/llava-1.5-7b-hf's 7.06B counts the whole CLIP tower; our flavor builds its 23 layers that
    # LLaVA reads (vision_feature_layer -2), so the count adds the 24th back.
    ("llava", "llava-1.5-7b"): Published(Count(7.06, digits=2, unit=1e9), changes={"vision": {
        "kind": "clip", "image_size": 336, "patch_size": 14, "dim": 1024, "n_layers": 24, "n_heads": 16, "ffn_dim": 4096}}),
    # llava-hf/llava-1.5-13b-hf: 13.4B, the same way.
    ("llava", "llava-1.5-13b"): Published(Count(13.4, digits=1, unit=1e9), changes={"vision": {
        "kind": "clip", "image_size": 336, "patch_size": 14, "dim": 1024, "n_layers": 24, "n_heads": 16, "ffn_dim": 4096}}),
    # The Gemma 3 technical report's Table 1: embedding + non-embedding parameters of the language model
    # (the 4B-27B vision encoder's 417M apart; google/gemma-3-1b-pt has no vision encoder).
    ("gemma3", "1B"): Published(Count(302e6 + 698e6, rel=0.005)),
    ("gemma3", "4B"): Published(Count(675e6 + 3_209e6, rel=0.005)),
    ("gemma3", "12B"): Published(Count(1_012e6 + 10_759e6, rel=0.005)),
    ("gemma3", "27B"): Published(Count(1_416e6 + 25_600e6, rel=0.005)),
}

# Released-size flavors that name no released model, and why.
UNPUBLISHED = {
    ("llama3", "100M"): "a size of our own for CPU runs (its count with the debug tokenizer: tests/unit/test_llama3_model.py)",
    ("toy", "tiny"): "the test-only family of tests/toy_family.py",
}
