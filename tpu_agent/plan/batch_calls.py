"""The fixed-length `pad_batch` change as a source edit, where the script pads its batches through a call that
takes the length: the patch a reviewer reads, beside the run-time form that was measured.

A tokenizer call with `padding=True` or `padding="longest"`, or a Hugging Face collator that pads
(`DataCollatorWithPadding`, `DataCollatorForSeq2Seq`, `DataCollatorForTokenClassification`,
`DataCollatorForLanguageModeling`), gets `pad_to_multiple_of=L`: every batch of at most L is then padded to L,
and a longer one to a multiple of L, with the tokenizer's own pad values: what `PadBatch(buckets=(L,))` does
where the batch leaves the loader. A plan of several buckets has no such keyword (the run-time form stays the
only form), nor does a script that pads otherwise (`pad_sequence` in its own collate function): its
instruction says what to write.
"""

from __future__ import annotations

from dataclasses import dataclass

from tpu_agent.plan.actions import PadBatch, Plan

COLLATORS = ("DataCollatorWithPadding", "DataCollatorForSeq2Seq", "DataCollatorForTokenClassification",
             "DataCollatorForLanguageModeling")
KEYWORD = "pad_to_multiple_of"


@dataclass(frozen=True)
class PaddingCall:
    """A call in the script that pads a batch to its own longest, by position (libcst's: 1-based line)."""

    line: int
    column: int
    name: str


def fixed_length(plan: Plan) -> int | None:
    """The one length the plan pads batches to, when its pad_batch has a single bucket."""
    pads = plan.of(PadBatch)
    return pads[0].buckets[0] if pads and len(pads[0].buckets) == 1 else None


def batch_in_source(plan: Plan, script) -> bool:
    """Whether the plan's pad_batch has a source form in `script` (one length, a padding call to take it)."""
    from pathlib import Path

    try:
        return fixed_length(plan) is not None and bool(padding_calls(Path(script).read_bytes()))
    except OSError:
        return False


def run_time_actions(plan: Plan, script) -> list:
    """The plan's actions that its source patch does not hold: what `tpu-agent run --plan` alone applies."""
    in_source = {"pad_dim", *(["pad_batch"] if batch_in_source(plan, script) else [])}
    return [a for a in plan.actions if a.kind not in in_source]


def _call_name(call) -> str:
    import libcst as cst

    func = call.func
    if isinstance(func, cst.Attribute):
        return func.attr.value
    return func.value if isinstance(func, cst.Name) else ""


def _pads_to_longest(call) -> bool:
    import libcst as cst

    name = _call_name(call)
    for arg in call.args:
        if arg.keyword is None or arg.keyword.value != "padding":
            continue
        value = arg.value
        longest = (isinstance(value, cst.Name) and value.value == "True") or (
            isinstance(value, cst.SimpleString) and value.evaluated_value == "longest")
        return longest  # padding="max_length" or False: the call fixes its length already, or pads nothing
    return name in COLLATORS  # a collator pads to the longest by default


def padding_calls(source: bytes) -> list[PaddingCall]:
    """The calls of `source` that pad a batch to its longest and take `pad_to_multiple_of`."""
    import libcst as cst
    from libcst.metadata import MetadataWrapper, PositionProvider

    found: list[PaddingCall] = []

    class Find(cst.CSTVisitor):
        METADATA_DEPENDENCIES = (PositionProvider,)

        def visit_Call(self, node: cst.Call) -> None:
            if _pads_to_longest(node):
                start = self.get_metadata(PositionProvider, node).start
                found.append(PaddingCall(start.line, start.column, _call_name(node)))

    try:
        MetadataWrapper(cst.parse_module(source)).visit(Find())
    except cst.ParserSyntaxError:
        return []
    return found


def pad_calls_to(source: bytes, length: int) -> bytes:
    """`source` with `pad_to_multiple_of=length` in every call `padding_calls` finds (an existing value replaced)."""
    import libcst as cst

    class Edit(cst.CSTTransformer):
        def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
            if not _pads_to_longest(original):
                return updated
            value = cst.Integer(str(length))
            args = list(updated.args)
            for i, arg in enumerate(args):
                if arg.keyword is not None and arg.keyword.value == KEYWORD:
                    args[i] = arg.with_changes(value=value)
                    return updated.with_changes(args=args)
            if args and args[-1].comma == cst.MaybeSentinel.DEFAULT:
                args[-1] = args[-1].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
            args.append(cst.Arg(keyword=cst.Name(KEYWORD), value=value,
                                equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""),
                                                      whitespace_after=cst.SimpleWhitespace(""))))
            return updated.with_changes(args=args)

    return cst.parse_module(source).visit(Edit()).bytes
