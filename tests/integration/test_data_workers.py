"""The default loader with DataLoader worker processes, resumed mid-stream: what the uninterrupted loader
gives (titanlike/data). Without workers, and the rest of the loader: tests/unit/test_data.py."""

from __future__ import annotations

import pytest

from data_checks import check_resume_mid_stream, default_loader
from titanlike.data import DEFAULT_TOKENIZER_PATH, build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(DEFAULT_TOKENIZER_PATH)


# The id of the case it was in tests/unit/test_data.py, where "default" and "stream" stay.
@pytest.mark.parametrize("kind", ["default_workers"])
def test_resume_mid_stream(tok, kind):
    check_resume_mid_stream(lambda: default_loader(tok, rank=1, dp=2, local=2, num_workers=2))
