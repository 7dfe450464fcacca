"""app.tools.try_configs: each outcome counted by what the user saw (trained, one line, a traceback)."""
from app.tools import try_configs


def test_each_outcome_is_counted_by_what_the_user_saw():
    assert try_configs.outcome("done: eval_loss 0.3\n", 0) == ("trained", "")
    assert try_configs.outcome("mode: ...\nerror: x.json: unknown DeepSpeed key 'a'\n", 2) == \
        ("one line", "error: x.json: unknown DeepSpeed key 'a'")
    assert try_configs.outcome("Traceback (most recent call last):\n  ...\nKeyError: 'b'\n", 1) == \
        ("traceback", "KeyError: 'b'")
