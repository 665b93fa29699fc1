"""The compatibility names the model code uses across transformers 5.12-5.24 (decoderlab/compat_decoderlab.py).
The real check is the version matrix (tests/version_matrix, `make test-versions`); these cover the rules each shim
keeps under the installed release."""

import pytest
import torch

from decoderlab.compat_decoderlab import accepts_past_key_values, check_transformers_version


@pytest.mark.parametrize("version", ["5.11.0", "4.57.1", "6.0.0", "6.1.0.dev0"])
def test_unsupported_transformers_gets_one_clear_error(version):
    """A release outside >=5.12,<6 is refused at import with an ImportError naming it and the supported range."""
    with pytest.raises(ImportError, match=rf"needs transformers>=5.12,<6, but transformers {version} is installed"):
        check_transformers_version(version)


@pytest.mark.parametrize("version", ["5.12.0", "5.16.1", "5.24.0", "5.30.0.dev0"])
def test_supported_transformers_passes(version):
    check_transformers_version(version)


def test_a_cache_passed_as_past_key_values_arrives_as_cache():
    """generate() before 5.24 passes the cache as past_key_values, and may pass cache=None beside it: the real
    cache is kept (under 5.24, with transformers' deprecation warning); two different caches are refused rather
    than one silently dropped."""

    @accepts_past_key_values
    def forward(x, cache=None):
        return cache

    real = object()
    with pytest.warns(FutureWarning, match="`past_key_values` is deprecated"):  # cache is the name in 5.24
        assert forward(torch.zeros(1), past_key_values=real) is real
    assert forward(torch.zeros(1), past_key_values=real, cache=None) is real
    assert forward(torch.zeros(1), cache=real, past_key_values=None) is real
    assert forward(torch.zeros(1), cache=real, past_key_values=real) is real
    with pytest.raises(ValueError, match="two different KV caches"):
        forward(torch.zeros(1), cache=real, past_key_values=object())
