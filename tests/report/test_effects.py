"""Every change in a verified plan says what it does to the model, with measured figures where it adds parameters."""

from __future__ import annotations

from tpu_agent.plan.actions import Compile, MatmulPrecision, PadDim, PadOps, Plan
from tpu_agent.report.effects import effect_lines

VOCAB = PadDim(file="train.py", line=12, column=32, old=50257, new=50432, name="vocab_size", effect="model")
BATCH = PadDim(file="train.py", line=5, column=8, old=100, new=128, name="BATCH_SIZE", effect="training", batch=True)


def test_each_class_says_what_it_does():
    plan = Plan(actions=[Compile(mode="fused"), PadOps(multiple=256, sizes=(50257,)), VOCAB, BATCH,
                         MatmulPrecision(precision="default")])
    assert plan.effects() == ["exact", "numerics", "model", "training"]
    fused, pad, vocab, batch, bf16 = effect_lines(plan, [3_383_552, 3_394_752])
    assert fused.startswith("numerics (same model, other rounding): compile")
    assert pad == 'exact (same math): pad_ops {"multiple":256,"sizes":[50257]}'
    assert vocab.startswith("model (a different architecture): vocab_size 50257->50432 (train.py:12); "
                            "parameters 3,383,552 -> 3,394,752 (+11,200, measured)")
    assert "the 175 added vocabulary rows never appear in the data, so they are never labels" in vocab
    assert batch.startswith("training (different training (batch, sequence length") and "per sample" in batch
    assert bf16.startswith("numerics (same model, other rounding)") and "--loss-tol" in bf16


def test_unmeasured_parameters_are_said_to_be_unmeasured():
    (line,) = effect_lines(Plan(actions=[VOCAB]), [3_383_552, None])
    assert "parameters before and after not measured" in line


def test_compiled_steps_and_fused_execution_are_numerics_changes():
    from tpu_agent.plan.actions import Compile
    from tpu_agent.report.effects import effect_line

    compiled, fused = Compile(mode="compiled"), Compile(mode="fused")
    assert (compiled.effect, compiled.preserves_numerics) == ("numerics", False)
    assert (fused.effect, fused.preserves_numerics) == ("numerics", False)
    assert Compile(mode="eager").effect == "exact"
    assert Compile.model_validate({"kind": "compile", "mode": "compiled", "effect": "exact"}).effect == "numerics"
    assert "backward XLA derives from the forward" in effect_line(compiled, [])
    assert "fuses what eager ran op by op" in effect_line(fused, []) and "--loss-tol" in effect_line(fused, [])


def test_an_exact_change_whose_losses_were_off_alone_says_what_was_measured():
    from tpu_agent.search.records import TrialRecord

    fused, bf16, pad = Compile(mode="fused"), MatmulPrecision(precision="default"), PadOps(multiple=8)
    reason = "per-step losses match the baseline beyond 1e-05 relative (largest difference 2.01e-05 at step 47)"
    trials = [TrialRecord(number=2, plan=Plan(actions=[pad]), state="numerics", reason=reason),
              TrialRecord(number=5, plan=Plan(actions=[fused, bf16]), state="numerics", reason="off")]
    pad_line, bf16_line, fused_line = effect_lines(Plan(actions=[pad, bf16, fused]), [], trials)
    assert pad_line.startswith("exact (same math): pad_ops")
    assert "trial 2 (" in pad_line and "2.01e-05" in pad_line and "held to the loss tolerance" in pad_line
    assert "trial" not in fused_line  # a numerics change: its trial is not a failed exact check
    assert "trial" not in bf16_line
    (alone,) = effect_lines(Plan(actions=[pad]), [], trials[1:])
    assert "trial" not in alone
