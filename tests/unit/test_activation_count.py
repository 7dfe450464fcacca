"""The activations the memory plan counts (app/memory/activation_count.py): the eager step's on fake tensors as real
ones hold them, and the compiled step's graph's."""
import pytest
import torch

from app.memory import activation_count


def _tiny_gpt():
    from app.core import models
    from transformers import AutoModelForCausalLM
    spec = models.hf_spec("gpt2-tiny")
    return models.HFLogits(AutoModelForCausalLM.from_config(spec.config))


@pytest.mark.parametrize("checkpointed, weights16", [(False, False), (True, False), (False, True)])
def test_fake_tensors_count_the_activation_bytes_real_ones_hold(checkpointed, weights16):
    """No weight allocated, the same count: the plan measures a 7B model on a laptop."""
    from app.core.tasks import next_token_loss
    torch.manual_seed(0)

    def inputs(b):
        ids = torch.randint(8000, (b, 64))
        return [ids], ids
    counted = [activation_count.activation_bytes(_tiny_gpt, inputs, next_token_loss, 2, torch.bfloat16, checkpointed, fake=fake,
                                     weights16=weights16) for fake in (True, False)]
    assert counted[0] == counted[1] > 0


def test_a_view_of_a_weight_made_before_is_not_counted():
    """bf16 weights are used as they are (a linear layer takes weight.t(), a view): nothing new is held."""
    layer = torch.nn.Linear(256, 256, bias=False).requires_grad_(False)  # frozen: no gradient of its size either

    def inputs(b):
        return [torch.randn(b, 256, requires_grad=True)], torch.zeros(b, dtype=torch.long)
    held = activation_count.activation_bytes(lambda: layer, inputs, lambda out, y: out.sum(1), 1, None, False, fake=False)
    assert held < 256 * 256 * 4 / 2, "the weight's transpose counted as new bytes"


def test_storages_freed_on_another_thread_while_this_one_counts_are_all_taken_off():
    """A collective's thread frees what it held last while this thread counts new storages (the real engine's step
    in tests/e2e/test_plan.py): no decrement is lost between this thread's read and write of the live bytes, which
    would leave the peak of a later moment too high. Thread switches forced as often as Python allows."""
    import queue
    import sys
    import threading
    handed = queue.Queue()

    def drop():
        while handed.get() is not None:
            pass  # the tensor's last reference goes with the loop's variable, on this thread
    thread, interval = threading.Thread(target=drop), sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        with activation_count.LiveBytes() as counter:
            thread.start()
            for _ in range(150_000):
                handed.put(torch.ones(64))  # 256 B, freed over there
                torch.zeros(32).add_(1)  # counted and freed here
            handed.put(None)
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert counter.live == 0 and counter.peak > 0


def test_checkpointing_holds_fewer_activations():
    from app.core.tasks import next_token_loss

    def inputs(b):
        ids = torch.randint(8000, (b, 128))
        return [ids], ids
    plain, checkpointed = (activation_count.activation_bytes(_tiny_gpt, inputs, next_token_loss, 4, torch.bfloat16, on)
                           for on in (False, True))
    assert checkpointed < 0.8 * plain


def test_a_compiled_step_keeps_what_its_graph_saves_linear_in_the_micro_batch_and_less_than_eager():
    """torch.compile's forward graph of the step, traced on fake tensors: the bytes it keeps grow by the same step
    with each sample, and are far fewer than the eager step's peak (inductor recomputes the cheap ones)."""
    from app.core.tasks import next_token_loss

    def inputs(b):
        ids = torch.randint(8000, (b, 128))
        return [ids], ids
    kept = [activation_count.compiled_activation_bytes(_tiny_gpt, inputs, next_token_loss, b, torch.bfloat16)
            for b in (2, 4, 8)]
    assert kept[2] - kept[1] == pytest.approx(2 * (kept[1] - kept[0]), rel=0.01)
    eager = activation_count.activation_bytes(_tiny_gpt, inputs, next_token_loss, 8, torch.bfloat16, False)
    assert kept[2] < 0.6 * eager


def test_a_graph_keeps_its_outputs_but_not_its_inputs_views_and_the_largests_gradient():
    """sin(x @ w).sum(): the graph returns the loss (4 bytes), x @ w or its cosine (4 x 8 fp32) for the backward,
    and x's transpose for w's gradient, a view of an input (held anyway): not counted. The backward's first
    gradient is the size of the largest."""
    from app.ds.internals import torch_private
    w, x = torch.randn(8, 8, requires_grad=True), torch.randn(4, 8)
    graph = torch_private.compiled_forward_graph(lambda w, x: (x @ w).sin().sum(), w, x)
    returned = next(node for node in graph.graph.nodes if node.op == "output").args[0]
    assert len(returned) == 3 and "permute" in str(returned[2].target), graph.code
    assert activation_count.kept_bytes(graph) == 4 + 2 * 4 * 8 * 4


def test_under_deepspeeds_linear_a_compiled_step_keeps_no_cast_of_a_linear_weight():
    """DeepSpeed's linear (ZeRO-3) saves the weight itself, and dynamo keeps what an autograd function saves, so its
    backward casts the weight anew: counted so (recast), the graph keeps less by exactly the bf16 bytes of every
    Linear weight (a llama's, its tied output layer once). Under torch's linear, which saves the cast, recast
    changes nothing."""
    from app.core import resolver
    from app.ds import internals as ds_internals
    from app.memory import planner
    from app.settings import Settings
    build, inputs, loss, _ = planner.workload(resolver.build(Settings(model="llama-tiny")), 256)
    weights = {id(m.weight): m.weight.numel() for m in build().modules() if isinstance(m, torch.nn.Linear)}

    def kept(recast):
        return activation_count.compiled_activation_bytes(build, inputs, loss, 2, torch.bfloat16, recast=recast)
    with ds_internals.deepspeed_linear():
        assert kept(False) - kept(True) == 2 * sum(weights.values()) > 0
    assert kept(True) == kept(False)


def test_fake_tensors_count_no_causal_mask_that_a_real_run_of_unpacked_rows_skips():
    """transformers cannot read fake position ids, so it would build the whole causal mask that a real run of unpacked
    rows skips (SDPA's is_causal): llama-1b's eager plan at 16,384 tokens held 8.6 GB of it, the H200's step none.
    The plan's llama-tiny, as the plan builds it, counts on fake tensors what real ones hold."""
    from app.core import resolver
    from app.memory import planner
    from app.settings import Settings
    build, inputs, loss, _ = planner.workload(resolver.build(Settings(model="llama-tiny", block_size=128)), 128)
    torch.manual_seed(0)
    counted = [activation_count.activation_bytes(build, inputs, loss, 2, torch.bfloat16, False, fake=fake)
               for fake in (True, False)]
    assert counted[0] == counted[1] > 0


@pytest.mark.parametrize("model", ["llama-tiny", "gpt2-tiny"])
def test_packed_rows_count_the_mask_a_real_run_of_them_builds(model, tmp_path):
    """Instruction rows packed into blocks restart their position ids within a row, and transformers then builds a
    mask that keeps them apart, which SDPA keeps per layer: the plan of such a run gives the model those position
    ids and counts on fake tensors what real ones hold, more than the same blocks unpacked."""
    import json
    from app.core import resolver
    from app.memory import planner
    from app.settings import Settings
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Say {i}."},
                                                     {"role": "assistant", "content": f"{i}"}]}) + "\n"
                             for i in range(40)))
    counted = {}
    for packing in ("on", "off"):
        settings = Settings(model=model, tokenizer="bytes", dataset=str(chats), block_size=128, packing=packing)
        task = resolver.resolve(settings, resolver.spec_of(settings), tmp_path / packing)
        assert task.data.info.packed == (packing == "on")
        build, inputs, loss, _ = planner.workload(task, 128)
        torch.manual_seed(0)
        counted[packing] = [activation_count.activation_bytes(build, inputs, loss, 2, torch.bfloat16, False,
                                                              fake=fake) for fake in (True, False)]
    assert counted["on"][0] == counted["on"][1] and counted["off"][0] == counted["off"][1], counted
    masks = 4 * 2 * 128 * 128  # at least a byte per layer (4 in both), sample (2) and pair of its 128 positions
    assert counted["on"][0] - counted["off"][0] >= masks, counted
