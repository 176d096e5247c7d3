"""Node agent: agent → {journal, dataplane} → runtime drivers. The only code that touches the host."""
