"""The words a rank uses when it stopped only because another rank's process ended first, shared by the rank that
writes them (tpu_agent.backend.distributed.faults) and the tool that reads them to name the rank that failed first
(tpu_agent.measure.trials). Standard library only, like tpu_agent.envvars: the device may import it, and the
tool reads it without importing the device."""

from __future__ import annotations

# The start of a rank's own line when a partner died first: "another rank's process ended (gloo: ...)".
CONSEQUENCE_MARK = "another rank's process ended"

# What gloo says when the other end of a collective went away (its sockets closed).
GLOO_PARTNER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def gloo_partner_gone(text: str) -> bool:
    """`text` is gloo's error for a collective whose partner's process went away, not a fault of this rank."""
    return "Gloo" in text and any(s in text for s in GLOO_PARTNER_GONE)
