"""The replica's adapter management: vLLM's load/unload calls, the ``/admin/*`` API the operator and
the router call (``routes``), the engine as that API shows it (``view``), and a candidate
version's golden-output check (``quality_gate``)."""
