"""The online serving campaign (issue 37): `detserve serve` under Poisson traffic, mode by
mode, inside a time budget. ``plan`` (what runs, and what the budget cuts), ``server`` (a
`detserve serve` subprocess), ``analysis`` (saturation, the latency targets), ``report``
(the Markdown report, Figure 11 and Table 5 analogues). The driver is
``benchmarks/online_campaign.py``."""
