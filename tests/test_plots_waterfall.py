"""plots.waterfall draws one real request's journey and labels every stage."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from tinyserve import LLM, SamplingParams  # noqa: E402
from tinyserve.book import plots


def test_waterfall_draws_every_stage_of_a_chunked_request():
    llm = LLM("tiny", seed=0, max_num_batched_tokens=16, enable_chunked_prefill=True)
    prompt = list(range(3, 43))                       # 40 tokens -> 3 prefill chunks of <= 16
    out = llm.generate([prompt], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    spans = plots.waterfall_spans(out)
    stages = [s for s, _, _ in spans]
    assert stages.count("prefill") == 3
    assert stages.count("decode") == 4                # 5 tokens: the first comes with prefill
    assert all(d >= 0 for _, _, d in spans)
    starts = [t for s, t, _ in spans if s in ("prefill", "decode")]
    assert starts == sorted(starts)
    ax = plots.waterfall(out)
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == list(plots.WATERFALL_STAGES)
    assert ax.get_xlabel()
    ax.figure.canvas.draw()
    plt.close(ax.figure)
