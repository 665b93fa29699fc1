"""transformers' own common model tests (``ModelTesterMixin`` of the installed transformers release's source
distribution) run against DecoderLabModel, DecoderLabForCausalLM and DecoderLabForSequenceClassification, for four block
and position layouts. They protect the contract every transformers model keeps (save/load, missing and
unexpected weights, resizing embeddings, attention outputs and hidden states, gradient checkpointing,
attention backends, initialisation, ...), which tools (PEFT, TRL, vLLM, Accelerate) rely on.

transformers' tests are not vendored: ``make hf-tests`` downloads the sdist from PyPI and unpacks its
``tests/`` folder into ``.hf-tests/`` (gitignored); ``DECODERLAB_HF_TESTS`` names that folder. Without it this
module collects one test, which fails and says how to get the suite: a missing suite must never read as a pass.

The sdist carries ``tests/test_modeling_common.py`` but not the two modules it imports at the top,
``tests/exporters/test_export.py`` (``ExportTesterMixin``, the torch.export tests ModelTesterMixin inherits)
and ``tests/generation/test_utils.py`` (``GenerationTesterMixin``). Where the folder lacks them, empty
stand-ins are registered under those names so that ModelTesterMixin's own tests import, and the export and
``generate`` tests do not run here (generation is covered by tests/test_cache_and_generation.py). Where the
folder has them (a full transformers checkout at the same release; not tried here), they are used.
"""

import importlib
import os
import pathlib
import sys
import types
import unittest
from unittest.mock import patch

import pytest
import torch
import transformers

from decoderlab import (
    DecoderLabConfig,
    DecoderLabForCausalLM,
    DecoderLabForSequenceClassification,
    DecoderLabModel,
)

ENV_VAR = "DECODERLAB_HF_TESTS"
PACKAGE = "hf_common_tests"  # transformers' tests/ folder imported under this name (ours is `tests`)
HOW_TO_GET = (
    f"`make test` fetches them and sets {ENV_VAR}; by hand: `make hf-tests` (unpacks transformers' sdist from "
    f"PyPI into .hf-tests/), then {ENV_VAR}=.hf-tests/transformers-<version>/tests."
)


def _hf_tests_folder() -> pathlib.Path | None:
    folder = os.environ.get(ENV_VAR)
    if not folder:
        return None
    folder = pathlib.Path(folder)
    if not (folder / "test_modeling_common.py").is_file():
        raise RuntimeError(f"{ENV_VAR}={folder} has no test_modeling_common.py. {HOW_TO_GET}")
    # The sdist's PKG-INFO names its release: tests of another release than the installed one fail for
    # reasons that are not decoderlab's
    pkg_info = folder.parent / "PKG-INFO"
    if pkg_info.is_file():
        release = next(
            line.split(":", 1)[1].strip() for line in pkg_info.read_text().splitlines() if line.startswith("Version:")
        )
        if release != transformers.__version__:
            raise RuntimeError(
                f"{ENV_VAR}={folder} holds the tests of transformers {release}, but {transformers.__version__} is "
                f"installed: unpack the sdist of {transformers.__version__} (make hf-tests HF_VERSION=...)."
            )
    return folder


def _stand_in(name: str, **attributes) -> None:
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    sys.modules[name] = module


def _import_common_tests(folder: pathlib.Path) -> types.ModuleType:
    """Import ``folder/test_modeling_common.py`` as ``hf_common_tests.test_modeling_common`` (its relative
    imports resolve inside ``folder``), with stand-ins for the two submodules the sdist does not ship."""
    package = types.ModuleType(PACKAGE)
    package.__path__ = [str(folder)]
    sys.modules[PACKAGE] = package
    if not (folder / "exporters" / "test_export.py").is_file():
        _stand_in(f"{PACKAGE}.exporters", __path__=[])
        _stand_in(f"{PACKAGE}.exporters.test_export", ExportTesterMixin=type("ExportTesterMixin", (), {}))
    if not (folder / "generation" / "test_utils.py").is_file():
        _stand_in(f"{PACKAGE}.generation", __path__=[])
        # A class nothing inherits from: test_generation_tester_mixin_inheritance cannot pass by accident
        _stand_in(f"{PACKAGE}.generation.test_utils", GenerationTesterMixin=type("GenerationTesterMixin", (), {}))
    return importlib.import_module(f"{PACKAGE}.test_modeling_common")


HF_TESTS = _hf_tests_folder()

if HF_TESTS is None:

    def test_transformers_common_tests_are_available():
        """Fails while the transformers test suite is missing, so that its absence is never read as a pass."""
        pytest.fail(f"transformers' common model tests were not run: {ENV_VAR} is not set. {HOW_TO_GET}")

else:
    pytestmark = pytest.mark.slow  # about 4 minutes on 2 cores; the failure above is never deselected as slow
    common = _import_common_tests(HF_TESTS)
    ModelTesterMixin = common.ModelTesterMixin
    ids_tensor, random_attention_mask = common.ids_tensor, common.random_attention_mask
    GenerationTesterMixin = sys.modules[f"{PACKAGE}.generation.test_utils"].GenerationTesterMixin
    HAS_GENERATION_TESTS = (HF_TESTS / "generation" / "test_utils.py").is_file()
    from transformers.models.auto import modeling_auto
    from transformers.testing_utils import torch_device

    @pytest.fixture(autouse=True, scope="module")
    def _decoderlab_in_transformers_name_tables():
        """The common tests choose inputs and labels by looking a class's name up in transformers' tables of
        in-library models (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, ...): list decoderlab there while they run,
        as it would be if it lived in transformers. The Auto classes still resolve through decoderlab's
        own registration (these tables hold names, not classes)."""
        tables = {
            "MODEL_MAPPING_NAMES": DecoderLabModel,
            "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES": DecoderLabForCausalLM,
            "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES": DecoderLabForSequenceClassification,
        }
        patches = [
            patch.dict(getattr(modeling_auto, table), {DecoderLabConfig.model_type: cls.__name__})
            for table, cls in tables.items()
        ]
        for p in patches:
            p.start()
        yield
        for p in reversed(patches):
            p.stop()

    class DecoderLabModelTester:
        """Builds a tiny DecoderLabConfig and random inputs for the common tests (transformers'
        LlamaModelTester, written for decoderlab). ``overrides`` select the block and position layout."""

        def __init__(
            self,
            parent: unittest.TestCase,
            batch_size: int = 13,
            seq_length: int = 7,
            is_training: bool = True,
            use_input_mask: bool = True,
            use_labels: bool = True,
            vocab_size: int = 99,
            hidden_size: int = 32,
            num_hidden_layers: int = 2,
            num_attention_heads: int = 4,
            num_key_value_heads: int = 2,
            intermediate_size: int = 37,
            hidden_act: str = "gelu",
            max_position_embeddings: int = 512,
            num_labels: int = 3,
            pad_token_id: int = 0,
            bos_token_id: int = 1,
            eos_token_id: int = 2,
            **overrides,
        ):
            self.parent = parent
            self.batch_size, self.seq_length = batch_size, seq_length
            self.is_training, self.use_input_mask, self.use_labels = is_training, use_input_mask, use_labels
            self.vocab_size, self.hidden_size = vocab_size, hidden_size
            self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads
            self.num_key_value_heads, self.intermediate_size = num_key_value_heads, intermediate_size
            self.hidden_act, self.max_position_embeddings = hidden_act, max_position_embeddings
            self.num_labels = num_labels
            self.pad_token_id, self.bos_token_id, self.eos_token_id = pad_token_id, bos_token_id, eos_token_id
            self.overrides = overrides

        def get_config(self) -> DecoderLabConfig:
            return DecoderLabConfig(
                vocab_size=self.vocab_size,
                hidden_size=self.hidden_size,
                num_hidden_layers=self.num_hidden_layers,
                num_attention_heads=self.num_attention_heads,
                num_key_value_heads=self.num_key_value_heads,
                intermediate_size=self.intermediate_size,
                hidden_act=self.hidden_act,
                max_position_embeddings=self.max_position_embeddings,
                num_labels=self.num_labels,
                pad_token_id=self.pad_token_id,
                bos_token_id=self.bos_token_id,
                eos_token_id=self.eos_token_id,
                **self.overrides,
            )

        def prepare_config_and_inputs(self):
            input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
            input_mask = random_attention_mask([self.batch_size, self.seq_length]) if self.use_input_mask else None
            sequence_labels = token_labels = None
            if self.use_labels:
                sequence_labels = ids_tensor([self.batch_size], self.num_labels)
                token_labels = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
            return self.get_config(), input_ids, input_mask, sequence_labels, token_labels

        def prepare_config_and_inputs_for_common(self):
            config, input_ids, input_mask, _, _ = self.prepare_config_and_inputs()
            return config, {"input_ids": input_ids, "attention_mask": input_mask}

        def check_model(self, config, input_ids, input_mask, *_):
            model = DecoderLabModel(config).to(torch_device).eval()
            with torch.no_grad():
                out = model(input_ids, attention_mask=input_mask)
            self.parent.assertEqual(out.last_hidden_state.shape, (self.batch_size, self.seq_length, self.hidden_size))

        def check_causal_lm(self, config, input_ids, input_mask, _, token_labels):
            model = DecoderLabForCausalLM(config).to(torch_device).eval()
            with torch.no_grad():
                out = model(input_ids, attention_mask=input_mask, labels=token_labels)
            self.parent.assertEqual(out.logits.shape, (self.batch_size, self.seq_length, self.vocab_size))
            self.parent.assertTrue(torch.isfinite(out.loss))

        def check_sequence_classification(self, config, input_ids, input_mask, sequence_labels, _):
            model = DecoderLabForSequenceClassification(config).to(torch_device).eval()
            with torch.no_grad():
                out = model(input_ids, attention_mask=input_mask, labels=sequence_labels)
            self.parent.assertEqual(out.logits.shape, (self.batch_size, self.num_labels))

    # The mixins' order as in transformers' model tests: GenerationTesterMixin only when the folder has it
    _bases = (ModelTesterMixin, GenerationTesterMixin) if HAS_GENERATION_TESTS else (ModelTesterMixin,)

    class _DecoderLabCommonTests(*_bases):
        """The common tests for one layout; subclasses set ``config_overrides``."""

        config_overrides: dict = {}
        all_model_classes = (DecoderLabModel, DecoderLabForCausalLM, DecoderLabForSequenceClassification)
        # test_can_init_all_missing_weights dates a model by a "# Copyright YYYY" line in its config file and
        # skips models "older than 2023"; decoderlab's files have no such line, so without this it never runs
        test_can_init_all_missing_weights_before_2023 = True

        def setUp(self):
            self.model_tester = DecoderLabModelTester(self, **self.config_overrides)

        def test_model(self):
            """The base model's output has shape (batch, seq, hidden)."""
            self.model_tester.check_model(*self.model_tester.prepare_config_and_inputs())

        def test_causal_lm(self):
            """The LM head gives (batch, seq, vocab) logits and a finite loss from labels."""
            self.model_tester.check_causal_lm(*self.model_tester.prepare_config_and_inputs())

        def test_sequence_classification(self):
            """The classifier gives one row of scores per sequence."""
            self.model_tester.check_sequence_classification(*self.model_tester.prepare_config_and_inputs())

        if not HAS_GENERATION_TESTS:

            def test_generation_tester_mixin_inheritance(self):
                self.skipTest(
                    f"{HF_TESTS} has no generation/test_utils.py (transformers' sdist does not ship it), so there "
                    "is no GenerationTesterMixin to inherit; generate() is tested in tests/test_cache_and_generation.py"
                )

    class DecoderLabDefaultTest(_DecoderLabCommonTests, unittest.TestCase):
        """The default config: pre-RMSNorm, RoPE, gated MLP. partial_rotary_factor=1.0 (the default, spelled out)
        lets test_model_rope_with_partial_rotation run: it tries 0.5 only on configs that name the key."""

        config_overrides = {
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}
        }

    class DecoderLabPostNormLearnedTest(_DecoderLabCommonTests, unittest.TestCase):
        """Post-LN blocks (no final norm) with learned absolute positions, and scaled token embeddings (inside
        ``get_input_embeddings()``, which the inputs_embeds and resizing tests go through)."""

        config_overrides = {"norm_placement": "post", "position_embedding_type": "learned", "embedding_multiplier": 4.0}

    class DecoderLabSandwichSinusoidalTest(_DecoderLabCommonTests, unittest.TestCase):
        """Sandwich-LN blocks with fixed sinusoidal positions (a non-persistent buffer)."""

        config_overrides = {"norm_placement": "sandwich", "position_embedding_type": "sinusoidal"}

    class DecoderLabParallelNoPositionsTest(_DecoderLabCommonTests, unittest.TestCase):
        """GPT-NeoX's parallel residual without any position information (NoPE)."""

        config_overrides = {"use_parallel_residual": True, "position_embedding_type": "none"}

    class DecoderLabSlidingRopeFreeTest(_DecoderLabCommonTests, unittest.TestCase):
        """A per-layer layout: a sliding layer (a 3-token window over the 7-token inputs) without RoPE, then a full
        layer with it; two kinds of mask per forward, a bounded cache layer beside a growing one. Without attention
        sinks, which run on the eager attention only while these tests switch kernels."""

        config_overrides = {
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 3,
            "no_rope_layers": [0, 1],
        }
