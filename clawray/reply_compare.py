"""The promotion gate's judge-compared probe items: a candidate's replies against a reference version's.

Owns: the reference replies (those of the promoted and the best promoted version) of the probe items
that have no rule (``deploy.probe_file`` lines with ``"compare": true``), the order in which a pair is
shown to the judge, and the candidate's preference score. Must not: call a judge (the caller passes
``compare``), decide (:mod:`clawray.promotion`) or import beyond the standard library.

A compare item has no score of its own: paired with a reference version, the candidate scores its
preference ``(1 + s) / 2`` in {0, 0.5, 1}, ``s`` the judge's majority from the candidate's side (1 its
reply is better, -1 the reference's, 0 equal or no valid vote), and the reference scores 0.5 (a reply
ties with itself). So a candidate the judge finds no better and no worse than the promoted version pairs
0.5 with 0.5, and :func:`clawray.promotion.decide`'s sign test counts the judge's wins and losses (the
pairwise preference test of LLM-as-a-judge evaluations: Zheng et al. 2023, "Judging LLM-as-a-Judge with
MT-Bench and Chatbot Arena", section 3.1). Judges prefer one position (ibid., section 3.3): the
candidate is shown first on every other item, alternating with the version number, so a position bias
adds equally to both sides over the items.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

# compare(requests) -> scores: each request (messages, reply_a, reply_b, key), each score 1 (A better),
# -1 (B better) or 0 (equal), in the requests' order
Compare = Callable[[list[tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any], str]]], list[int]]


class ReplyComparisons:
    """The reference replies of the compare items and the candidate's preferences over them.

    Args:
        items: the positions of the compare items among the probe's scores (prompt-major, as
            :meth:`clawray.evaluation.Evaluator.run` returns them).
        messages: each compare item's conversation up to the reply, same order as ``items``.

    Attributes:
        replies: version -> its reply text per compare item (the versions still needed as references).
    """

    def __init__(self, items: Sequence[int], messages: Sequence[list[dict[str, Any]]]):
        if len(items) != len(messages):
            raise ValueError(f"{len(items)} compare items but {len(messages)} conversations")
        self.items, self.messages = list(items), list(messages)
        self.replies: dict[int, list[str]] = {}

    def __bool__(self) -> bool:
        return bool(self.items)

    def texts(self, replies: Sequence[str | None]) -> list[str]:
        """The compare items' texts out of one probe's reply texts (all items, prompt-major)."""
        return [replies[i] or "" for i in self.items]

    def keep(self, version: int, texts: Sequence[str], needed: set[int]) -> None:
        """Keep ``version``'s compare-item ``texts`` as a reference and forget the versions not in
        ``needed`` (the promoted and the best promoted one)."""
        self.replies[version] = list(texts)
        self.replies = {v: t for v, t in self.replies.items() if v in needed | {version}}

    def preferences(
        self, version: int, texts: Sequence[str], references: Sequence[int], compare: Compare
    ) -> dict[int, list[float]]:
        """Candidate ``version``'s preference per compare item over each reference version's reply,
        from one batch of ``compare`` calls; ``{reference: [p in {0, 0.5, 1}, ...]}``.

        Raises:
            KeyError: a reference version whose replies are not kept.
        """
        refs = [r for r in dict.fromkeys(references)]
        requests, flips = [], []
        for ref in refs:
            for j, (messages, mine, theirs) in enumerate(zip(self.messages, texts, self.replies[ref])):
                first = (j + version) % 2 == 0  # the candidate is reply A on every other item
                a, b = (mine, theirs) if first else (theirs, mine)
                requests.append((messages, _message(a), _message(b), f"v{version}/v{ref}/{j}"))
                flips.append(1 if first else -1)
        scores = compare(requests) if requests else []
        prefs = [(1 + f * int(s)) / 2 for f, s in zip(flips, scores, strict=True)]
        k = len(self.items)
        return {ref: prefs[i * k : (i + 1) * k] for i, ref in enumerate(refs)}

    def paired(self, scores: Sequence[float], prefs: Sequence[float]) -> list[float]:
        """The candidate's probe ``scores`` with each compare item's 0.5 replaced by its preference
        over one reference (whose own scores hold 0.5 there)."""
        out = list(scores)
        for i, p in zip(self.items, prefs, strict=True):
            out[i] = p
        return out


def _message(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}
