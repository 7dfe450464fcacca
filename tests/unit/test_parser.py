"""DeepSpeed's config parser as the app asks it (app/ds/internals/parser.py): what it reads, its fields, defaults."""
import pytest
from deepspeed.runtime.config import DeepSpeedConfig
from pydantic import ValidationError

from app.ds.internals.parser import Recorder, parse_config, scalar_defaults, section_fields


def test_a_recorder_notes_each_key_read_by_index_get_or_in_at_every_level():
    ds = Recorder({"a": 1, "b": 2, "c": 3, "section": {"x": 1, "y": 2}})
    assert ds["a"] == 1 and ds.get("missing") is None and "b" in ds
    assert ds["section"].get("x") == 1
    assert ds.read == {"a", "missing", "b", "section"} and ds["section"].read == {"x"}


def test_deepspeeds_parser_reads_the_keys_it_knows_and_never_a_misspelled_one():
    """How the app finds a key DeepSpeed would silently ignore, at the top and inside a section read key by key."""
    ds = Recorder({"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0, "gradient_clipin": 1.0,
                   "flops_profiler": {"enabled": False, "profile_step": 2, "profile_stepp": 3}})
    parse_config(ds)
    assert {"train_micro_batch_size_per_gpu", "gradient_clipping", "flops_profiler"} <= ds.read
    assert "gradient_clipin" not in ds.read
    profiler = dict.__getitem__(ds, "flops_profiler")
    assert {"enabled", "profile_step"} <= profiler.read and "profile_stepp" not in profiler.read


def test_a_file_whose_global_batch_is_for_several_ranks_parses_in_one_process():
    ds = {"train_batch_size": 24, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}
    with pytest.raises(AssertionError, match=r"24 != 4 \* 3 \* 1"):
        DeepSpeedConfig(dict(ds))
    assert parse_config(ds).train_batch_size == 12 == ds["train_batch_size"]
    assert parse_config({"train_micro_batch_size_per_gpu": 5}).train_batch_size == 5


def test_scalar_defaults_are_what_deepspeeds_parser_takes_for_a_key_left_out():
    defaults = scalar_defaults()
    parsed = DeepSpeedConfig({"train_batch_size": 1})
    compared = {key: getattr(parsed, key) for key in defaults
                if isinstance(getattr(parsed, key, None), (bool, int, float, str))}
    assert len(compared) >= 10 and compared == {key: defaults[key] for key in compared}
    assert type(defaults["gradient_clipping"]) is float and type(defaults["wall_clock_breakdown"]) is bool
    assert not [value for value in defaults.values() if not isinstance(value, (bool, int, float, str))]


@pytest.mark.parametrize("section, field", [
    ({"zero_optimization": {"stage": 2, "overlap_com": True}}, "overlap_comm"),
    ({"bf16": {"enabled": True, "check_grad_overflw": False}}, "check_grad_overflow"),
    ({"fp16": {"enabled": False, "loss_scale_windw": 100}}, "loss_scale_window"),
])
def test_a_section_deepspeed_refuses_is_named_by_a_title_whose_fields_the_app_lists(section, field):
    """A typo in a section DeepSpeed checks with pydantic gets its 'did you mean' from these fields."""
    with pytest.raises(ValidationError) as caught:
        parse_config({"train_micro_batch_size_per_gpu": 1, **section})
    assert field in section_fields(caught.value.title)


def test_the_bf16_section_takes_no_loss_scaling_and_fp16_does():
    """A bf16 section copied from fp16's loss scaling is trimmed to the fields DeepSpeed takes there."""
    assert {"enabled", "check_grad_overflow"} <= section_fields("DeepSpeedBF16Config")
    assert "loss_scale" not in section_fields("DeepSpeedBF16Config")
    assert {"loss_scale", "initial_scale_power"} <= section_fields("DeepSpeedFP16Config")
    assert section_fields("NoSuchConfig") == set()
    assert {"device", "pin_memory"} <= section_fields("DeepSpeedZeroConfig", ("offload_optimizer",))
    assert section_fields("DeepSpeedZeroConfig", ("stage",)) == set(), "a number holds no fields"
