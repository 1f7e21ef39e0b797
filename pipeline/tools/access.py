"""Which server tools each tenant may use.

The settings give, per tenant (and under "*" for every tenant without an entry of its own), the
tools it may use (`allow`: names, or "*" for all of them) and whether it may use the tools that
reach private networks (`private_network`, off unless given: an HTTP tool configured with
``allow_private`` fetches addresses inside the network, which no tenant should steer unless the
operator opts it in). With no settings every tenant may use every tool but those.

The request path asks three times: validation refuses a request that offers a tool its tenant
may not use (a 403 naming it), the planner plans only tools the tenant may use, and the tool
loop runs only the tools this request offered (which validation checked) and never another.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

ALL = "*"


@dataclass(frozen=True)
class TenantTools:
    """One tenant's tools: `allow` (None: every tool) and the private-network opt-in."""

    allow: frozenset[str] | None = None
    private_network: bool = False


class ToolAccess:
    """The tool policy of every tenant; `private` names the tools that reach private networks."""

    def __init__(
        self, tenants: Mapping[str, TenantTools] | None = None, private: Collection[str] = ()
    ) -> None:
        entries = dict(tenants or {})
        self.default = entries.pop(ALL, TenantTools())
        self.tenants = entries
        self.private = frozenset(private)

    @classmethod
    def from_settings(
        cls, tenants: Mapping[str, tuple[Collection[str], bool]], private: Collection[str] = ()
    ) -> ToolAccess:
        """From {tenant: (allowed names, private_network)}, where a name "*" allows all."""
        return cls(
            {
                tenant: TenantTools(None if ALL in allow else frozenset(allow), opt_in)
                for tenant, (allow, opt_in) in tenants.items()
            },
            private,
        )

    def for_tenant(self, tenant: str) -> TenantTools:
        return self.tenants.get(tenant, self.default)

    def allows(self, tenant: str, name: str) -> bool:
        policy = self.for_tenant(tenant)
        if name in self.private and not policy.private_network:
            return False
        return policy.allow is None or name in policy.allow

    def usable(self, tenant: str, names: Iterable[str]) -> list[str]:
        """Those of `names` the tenant may use, in order."""
        return [name for name in names if self.allows(tenant, name)]

    def unknown_names(self, known: Collection[str]) -> list[str]:
        """Names the policy allows that are no tool's (a typo in the settings)."""
        named = {n for p in [self.default, *self.tenants.values()] for n in p.allow or ()}
        return sorted(named - set(known))
