"""Transformers' own common model and config tests (`ModelTesterMixin`, `ConfigTester`) run against UltraMem.

They are not in the transformers wheel. The source distribution of the installed release on PyPI carries the
top-level `tests/test_*.py` (test_modeling_common.py, test_configuration_common.py, ...): `.ci/transformers_tests.sh`
downloads it with pip into `.transformers-src/<version>/transformers_tests/` (ignored, inside the clone) and runs
this module. The test classes are in `transformers_common_cases.py`; UltraMem-specific skips are there, each with
its reason.

The sdist leaves out test_modeling_common's subpackages; what stands in for each, defined here:
- `exporters/test_export.py` (`ExportTesterMixin`, upstream's torch.export tests): `ExportTesterMixin` below, one
  export check of the forward.
- `generation/test_utils.py` (`GenerationTesterMixin`, upstream's generate tests): `GenerationTesterMixin` below,
  UltraMem's own generation checks (cache on/off, left padding, continuing from a cache, the conv states' shape, and
  static-cache and compiled generation, gated on `_can_compile_fullgraph` as upstream gates its static-cache tests).
- `utils/test_configuration_utils.py` (`config_common_kwargs`): `CONFIG_COMMON_KWARGS` below, a value other than
  the default for each field every Transformers config has.
- `causal_lm_tester.py` (`CausalLMModelTester`): `UltraMemModelTester` in transformers_common_cases.py.

Without the sources this module fetches them first (with the script); where that fails (no PyPI) it fails with one
test that says how to fetch them, rather than skip, so CI cannot pass without running it; set
ULTRAMEM_SKIP_TRANSFORMERS_COMMON=1 to skip it where the sources are not wanted.
"""

import os
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from transformers.testing_utils import torch_device

SKIP_VARIABLE = "ULTRAMEM_SKIP_TRANSFORMERS_COMMON"
# torch.compile backend of the compiled-generation check: "aot_eager" captures the graph whole without Inductor's
# code generation; set ULTRAMEM_COMPILE_BACKEND=inductor to check that too (on a GPU machine)
COMPILE_BACKEND = os.environ.get("ULTRAMEM_COMPILE_BACKEND", "aot_eager")
SOURCES = Path(
    os.environ.get("ULTRAMEM_TRANSFORMERS_SOURCES")
    or Path(__file__).resolve().parents[2] / ".transformers-src" / transformers.__version__
)
FOUND = (SOURCES / "transformers_tests" / "test_modeling_common.py").is_file()
if not FOUND and not os.environ.get(SKIP_VARIABLE) and "ULTRAMEM_TRANSFORMERS_SOURCES" not in os.environ:
    # First run in a clone: fetch them (pip, from PyPI), so README's test command runs them with nothing else to do.
    # pytest-xdist's workers all import this module at once: one fetches under a lock, the others wait and find the
    # sources (two fetches at once replace each other's folder, and the workers then collect different tests).
    import fcntl
    import hashlib
    import subprocess
    import tempfile

    fetch = Path(__file__).resolve().parents[2] / ".ci" / "transformers_tests.sh"
    lock_name = f"ultramem-transformers-src-{hashlib.sha1(str(SOURCES).encode()).hexdigest()[:12]}.lock"
    with open(Path(tempfile.gettempdir()) / lock_name, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (SOURCES / "transformers_tests" / "test_modeling_common.py").is_file():
            subprocess.run(["bash", str(fetch), "--fetch-only"], capture_output=True, text=True, timeout=600)
    FOUND = (SOURCES / "transformers_tests" / "test_modeling_common.py").is_file()
MISSING = (
    f"Transformers {transformers.__version__}'s test sources are not in {SOURCES}: run `.ci/transformers_tests.sh "
    f"--fetch-only` (needs PyPI), or set {SKIP_VARIABLE}=1 to skip Transformers' common tests"
)

# The cache's name in model inputs and outputs: Transformers 5.24 renamed `past_key_values` to `cache`
CACHE = (
    "cache"
    if "cache" in transformers.modeling_outputs.CausalLMOutputWithPast.__dataclass_fields__
    else "past_key_values"
)

# A value other than PreTrainedConfig's default for each of its fields (Transformers 5.24): ConfigTester's
# check_config_arguments_init builds the config with them and checks every one is kept.
CONFIG_COMMON_KWARGS = {
    "return_dict": False,
    "output_hidden_states": True,
    "output_attentions": True,
    "dtype": "float16",
    "chunk_size_feed_forward": 5,
    "architectures": ["UltraMemForCausalLM"],
    "id2label": {0: "label"},
    "label2id": {"label": "0"},
    "problem_type": "regression",
}


class ExportTesterMixin:
    """Stands in for upstream's torch.export tests (not in the sdist): the forward of the base model and of the causal
    LM exports with `torch.export` (non-strict) and the exported program gives the model's outputs on other inputs."""

    def test_torch_export(self):
        if not self.test_torch_exportable:
            self.skipTest("test_torch_exportable is False")
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        _, other_inputs = self.model_tester.prepare_config_and_inputs_for_common()
        for model_class in self.all_model_classes[:2]:  # UltraMemModel, UltraMemForCausalLM
            model = model_class(config).to(torch_device).eval()
            program = torch.export.export(model, args=(), kwargs={**inputs, "use_cache": False}, strict=False)
            with torch.no_grad():
                exported = program.module()(**other_inputs, use_cache=False)
                expected = model(**other_inputs, use_cache=False)
            torch.testing.assert_close(exported[0], expected[0], rtol=1e-5, atol=1e-5)


class GenerationTesterMixin:
    """Stands in for upstream's `GenerationTesterMixin` (not in the sdist): UltraMem's generation checks.

    The test class provides `model_tester`, `all_generative_model_classes` (from `ModelTesterMixin`) and
    `_get_conv_state_shape`. Every check decodes greedily and compares the tokens and the logits of every step, so a
    memory layer whose cached state is wrong fails even where it does not change an argmax of the random model.
    """

    max_new_tokens = 4

    def prepare_config_and_inputs_for_generate(self, batch_size: int = 2):
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        input_ids = inputs["input_ids"][:batch_size].clamp(min=3)  # no pad, bos or eos in the prompt
        return config, {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}

    def _greedy(self, model, inputs: dict, new_tokens: int | None = None, **kwargs):
        # min_new_tokens: eos (a random model may emit it) would end some rows early and pad them
        new_tokens = new_tokens or self.max_new_tokens
        return model.generate(
            **inputs,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            return_dict_in_generate=True,
            output_logits=True,
            **kwargs,
        )

    def assert_same_steps(self, new_tokens: torch.Tensor, logits: tuple, expected_tokens, expected_logits) -> None:
        """The same generated tokens (B, n) and the same logits at each of the n steps."""
        self.assertTrue(torch.equal(new_tokens, expected_tokens), f"{new_tokens} != {expected_tokens}")
        torch.testing.assert_close(torch.stack(logits), torch.stack(expected_logits), rtol=1e-4, atol=1e-5)

    def assert_same_generation(self, output, expected) -> None:
        self.assertTrue(torch.equal(output.sequences, expected.sequences))
        self.assert_same_steps(output.sequences, output.logits, expected.sequences, expected.logits)

    def _models(self):
        for model_class in self.all_generative_model_classes:
            config, inputs = self.prepare_config_and_inputs_for_generate()
            model = model_class(config).to(torch_device).eval()
            # Off the init: the query conv starts as the identity (only its current tap is nonzero), which would hide
            # a conv state that is lost between decoding steps
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.add_(0.05 * torch.randn_like(parameter))
            yield model, inputs

    def test_greedy_generate_with_cache_matches_without(self):
        for model, inputs in self._models():
            self.assert_same_generation(self._greedy(model, inputs), self._greedy(model, inputs, use_cache=False))

    def test_cache_holds_conv_states_of_the_expected_shape(self):
        for model, inputs in self._models():
            config = model.config
            with torch.no_grad():
                cache = model(**inputs, use_cache=True)[CACHE]
            batch_size, length = inputs["input_ids"].shape
            self.assertEqual(cache.get_seq_length(), length)
            expected = self._get_conv_state_shape(batch_size, config)
            for layer_idx, state_idx in config.memory_conv_state_slots:
                self.assertEqual(tuple(cache.layers[layer_idx].conv_states[state_idx].shape), expected)

    def test_left_padding_compatibility(self):
        """Left-padded rows generate the tokens, with the logits, of the same rows unpadded."""
        for model, inputs in self._models():
            input_ids = inputs["input_ids"]
            pad = torch.full((input_ids.shape[0], 3), model.config.pad_token_id, dtype=input_ids.dtype)
            padded = {
                "input_ids": torch.cat([pad, input_ids], dim=1),
                "attention_mask": torch.cat([torch.zeros_like(pad), inputs["attention_mask"]], dim=1),
            }
            output, padded_output = self._greedy(model, inputs), self._greedy(model, padded)
            self.assert_same_steps(
                padded_output.sequences[:, padded["input_ids"].shape[1] :],
                padded_output.logits,
                output.sequences[:, input_ids.shape[1] :],
                output.logits,
            )

    def test_generate_continue_from_cache(self):
        """Generating n tokens, then n more from the returned cache, gives the 2n tokens of one generation."""
        n = self.max_new_tokens
        for model, inputs in self._models():
            whole = self._greedy(model, inputs, new_tokens=2 * n)
            first = self._greedy(model, inputs)
            ids = first.sequences
            next_inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), CACHE: first[CACHE]}
            second = self._greedy(model, next_inputs)
            self.assert_same_steps(second.sequences, first.logits + second.logits, whole.sequences, whole.logits)

    def test_generate_with_static_cache(self):
        """Greedy decoding with a static cache gives the tokens and logits of the dynamic one (upstream skips models
        that do not declare `_can_compile_fullgraph`, as here)."""
        for model, inputs in self._models():
            if not model._can_compile_fullgraph:
                self.skipTest("the model does not declare _can_compile_fullgraph")
            dynamic = self._greedy(model, inputs)
            self.assert_same_generation(self._greedy(model, inputs, cache_implementation="static"), dynamic)

    def test_generate_compile_model_forward_fullgraph(self):
        """`generate` with a static cache and the decoding step compiled whole (fullgraph=True) gives the eager tokens
        and logits, and a second generation reuses the compiled step without recompiling. The graph runs on
        AOTAutograd's eager backend: it checks that the step is captured whole, not what Inductor makes of it
        (minutes on a CPU; ULTRAMEM_COMPILE_BACKEND=inductor runs that)."""
        for model, inputs in self._models():
            if not model._can_compile_fullgraph:
                self.skipTest("the model does not declare _can_compile_fullgraph")
            torch.compiler.reset()
            eager = self._greedy(model, inputs)
            compile_config = transformers.CompileConfig(fullgraph=True, dynamic=False, backend=COMPILE_BACKEND)
            compile_config._compile_all_devices = True  # generate compiles on accelerators only, otherwise
            compiled = self._greedy(model, inputs, cache_implementation="static", compile_config=compile_config)
            self.assertTrue(hasattr(model, "_compiled_call"), "generate did not compile the forward")
            self.assert_same_generation(compiled, eager)
            with torch.compiler.set_stance("fail_on_recompile"):
                again = self._greedy(model, inputs, cache_implementation="static", compile_config=compile_config)
            self.assert_same_generation(again, eager)


def _install_sources() -> None:
    """Make `transformers_tests` importable, with the stand-ins above for the modules the sdist lacks."""
    sys.path.insert(0, str(SOURCES))
    stand_ins = {
        "transformers_tests.exporters": None,
        "transformers_tests.exporters.test_export": {"ExportTesterMixin": ExportTesterMixin},
        "transformers_tests.generation": None,
        "transformers_tests.generation.test_utils": {"GenerationTesterMixin": GenerationTesterMixin},
        "transformers_tests.utils": None,
        "transformers_tests.utils.test_configuration_utils": {"config_common_kwargs": CONFIG_COMMON_KWARGS},
    }
    for name, contents in stand_ins.items():
        module = types.ModuleType(name, "stand-in from tests/model/test_transformers_common.py")
        if contents is None:
            module.__path__ = []  # a package
        else:
            module.__dict__.update(contents)
        sys.modules.setdefault(name, module)


if FOUND:
    _install_sources()
    with warnings.catch_warnings():  # upstream's marks (flash_attn_test, torch_compile_test, ...) are unregistered here
        warnings.simplefilter("ignore", pytest.PytestUnknownMarkWarning)
        from transformers_common_cases import UltraMemModelTest, UltraMemProductKeyModelTest  # noqa: E402, F401
elif os.environ.get(SKIP_VARIABLE) == "1":
    pytest.skip(MISSING, allow_module_level=True)
else:

    def test_transformers_test_sources_are_present():
        pytest.fail(MISSING, pytrace=False)
