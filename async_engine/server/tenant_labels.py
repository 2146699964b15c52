"""Which tenants get their own metric label: a bounded set, earned by traffic.

First come, first labelled would let a client that sends one request under each of 64
random tenant names take every slot. Here a tenant gets its own label only after
``promote_after`` finished requests (tenants a token file names get one at once), at most
``max_labels`` of them; the rest share "other". The tally of not-yet-labelled tenants is
bounded too: when full, the least recently seen one is forgotten.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

OTHER = "other"
DEFAULT = "default"  # the label of requests that name no tenant


class TenantLabels:
    def __init__(
        self,
        max_labels: int = 64,
        promote_after: int = 8,
        max_candidates: int = 4096,
        preset: Iterable[str] = (),
    ) -> None:
        self.max_labels = max_labels
        self.promote_after = promote_after
        self.max_candidates = max_candidates
        self.labelled: set[str] = set()
        self._seen: OrderedDict[str, int] = OrderedDict()
        for tenant in preset:
            self.admit(tenant)

    def label(self, tenant: str) -> str:
        """The label of one finished request of ``tenant`` (counts toward its promotion)."""
        tenant = tenant or DEFAULT
        if tenant in self.labelled:
            return tenant
        count = self._seen.pop(tenant, 0) + 1
        if count >= self.promote_after and self.admit(tenant):
            return tenant
        self._seen[tenant] = count
        if len(self._seen) > self.max_candidates:
            self._seen.popitem(last=False)
        return OTHER

    def admit(self, tenant: str) -> bool:
        """Give ``tenant`` its own label now, if there is room."""
        if tenant in self.labelled:
            return True
        if len(self.labelled) >= self.max_labels or tenant == OTHER:
            return False
        self.labelled.add(tenant)
        return True
