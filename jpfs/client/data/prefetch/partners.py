"""Co-access: files opened together across directories, learned, and fetched as partners.

When opening ``A/x_42.parquet`` is followed by opening ``B/cam/x_42.mp4`` (the same number in the
name), a rule "A/x_N -> B/cam/x_N" is counted (``coaccess.py`` finds the pairings); once seen
twice, opening a file of shape A fetches its partners. Nothing about LeRobot is built in. A rule
whose predictions go unused is dropped.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Callable

from ....errors import JPFSError
from ....types import Attr
from ..coaccess import Opened, Rule, apply_rule, pairing, shape_of
from .config import PrefetchConfig, PrefetchStats
from .fetch import Fetcher
from .paths import Paths
from .sweeps import Sweeps

log = logging.getLogger(__name__)


class Partners:
    """The rules learned per shape of path and the predictions they made (see the module
    docstring)."""

    def __init__(self, config: PrefetchConfig, stats: PrefetchStats, paths: Paths,
                 sweeps: Sweeps, fetcher: Fetcher, kernel_has: Callable[[int, int], bool]):
        self.config = config
        self.stats = stats
        self.paths = paths
        self.sweeps = sweeps
        self.fetcher = fetcher
        self.kernel_has = kernel_has
        self._recent: OrderedDict[int, deque[Opened]] = OrderedDict()
        self._rules: dict[str, dict[tuple, Rule]] = {}
        self._predicted: OrderedDict[int, Rule] = OrderedDict()

    def hit(self, ino: int) -> Rule | None:
        """File ``ino`` was opened: the rule that predicted it, if one did (counted a hit)."""
        rule = self._predicted.pop(ino, None)
        if rule is not None:
            rule.hits += 1
            self.stats.coaccess_hits += 1
        return rule

    def predicts_from(self, path: str) -> bool:
        """Whether a co-access rule predicts, at opens of ``path``, a partner whose directory
        is not being swept (such opens must keep reaching ``opened``; a swept partner is
        fetched anyway)."""
        cur = shape_of(path)
        for rule in (self._rules.get(cur.shape) or {}).values():
            if rule.dropped or rule.seen < self.config.coaccess_min:
                continue
            p = apply_rule(rule.parts, cur.runs)
            got = self.paths.resolve_now(p) if p is not None and p != path else None
            if got is False:
                return True
            if got is not None and not self.sweeps.swept(got[0]):
                return True
        return False

    def opened(self, stream: int, path: str) -> None:
        """Reader ``stream`` opened ``path``: learn from its earlier opens, and fetch the
        partners its rules predict."""
        cfg = self.config
        cur = shape_of(path)
        recent = self._recent.get(stream)
        if recent is None:
            recent = self._recent[stream] = deque(maxlen=cfg.coaccess_window)
            while len(self._recent) > 1024:
                self._recent.popitem(last=False)
        else:
            self._recent.move_to_end(stream)
        # learn: which earlier opens of this thread name the same number as this one?
        seen_rules = set()
        key = cur.runs[cur.base_run] if cur.base_run >= 0 else None
        for prev in recent:
            if key is None or key not in prev.runs:
                continue  # the usual case, cheaply: no number in common
            parts = pairing(prev, cur)
            if parts is None or (prev.shape, parts) in seen_rules:
                continue
            seen_rules.add((prev.shape, parts))
            rules = self._rules.setdefault(prev.shape, {})
            rule = rules.get(parts)
            if rule is None:
                if len(rules) >= 64 or len(self._rules) > 4096:
                    continue
                rule = rules[parts] = Rule(parts)
            rule.seen += 1
            self.stats.coaccess_pairs += 1
            if rule.seen == cfg.coaccess_min:
                self.stats.coaccess_rules += 1
        recent.appendleft(cur)
        # predict: this file's partners by the rules learned for its shape
        shape_rules = self._rules.get(cur.shape)
        if not shape_rules:
            return
        targets = []
        for rule in shape_rules.values():
            if rule.dropped or rule.seen < cfg.coaccess_min:
                continue
            p = apply_rule(rule.parts, cur.runs)
            if p is not None and p != path:
                targets.append((p, rule))
        if not targets:
            return
        self.stats.coaccess_predictions += len(targets)
        found: list[Attr] = []
        later: list[tuple[str, Rule]] = []
        for p, rule in targets:  # resolved from listings at once when they are all here
            got = self.paths.resolve_now(p)
            if got is False:
                later.append((p, rule))
            else:
                self._predicted_file(rule, got[2] if got is not None else None, found)
        if found:
            self.stats.coaccess_files += len(found)
            self.fetcher.launch(None, attrs=found)
        if later:
            self.fetcher.spawn(self._predict, later)

    async def _predict(self, targets: list[tuple[str, Rule]]) -> None:
        found: list[Attr] = []
        for path, rule in targets:
            try:
                got = await self.paths.resolve(path)
            except JPFSError:
                got = None
            self._predicted_file(rule, got[2] if got is not None else None, found)
        if found:
            self.stats.coaccess_files += len(found)
            self.fetcher.launch(None, attrs=found)

    def _predicted_file(self, rule: Rule, attr: Attr | None, found: list[Attr]) -> None:
        if attr is None or not attr.is_reg:
            self._miss(rule)
            return
        if attr.ino in self._predicted or self.kernel_has(attr.ino, attr.version):
            return
        rule.predicted += 1
        self._predicted[attr.ino] = rule
        while len(self._predicted) > 4096:
            _, old = self._predicted.popitem(last=False)
            self._miss(old)
        found.append(attr)

    def _miss(self, rule: Rule) -> None:
        rule.misses += 1
        if not rule.dropped and rule.misses >= 8 and rule.misses > rule.hits:
            rule.dropped = True
            self.stats.coaccess_rules_dropped += 1
            log.info("co-access rule %r dropped: %d hits, %d misses", rule.parts, rule.hits,
                     rule.misses)

    def rules(self) -> list[dict]:
        """Learned co-access rules (for stats)."""
        out = []
        for shape, rules in self._rules.items():
            for r in rules.values():
                if r.seen >= self.config.coaccess_min:
                    out.append({"from": shape.replace("\0", "#"),
                                "to": "".join(p if isinstance(p, str) else f"{{{p}}}"
                                              for p in r.parts),
                                "seen": r.seen, "predicted": r.predicted, "hits": r.hits,
                                "misses": r.misses, "dropped": r.dropped})
        return out[:100]


__all__ = ["Partners"]
