"""Hub model cards for UltraMem checkpoints, and `ultramem-push` to publish a checkpoint in one commit."""

from ultramem.hub_cards.card import render_card, write_card

__all__ = ["render_card", "write_card"]
