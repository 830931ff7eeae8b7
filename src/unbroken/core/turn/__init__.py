"""A turn: the machine that owns each step (`machine`, `turn_table`), what it released
(`ledger`), and how a turn is finished in place after commit (`continuation`,
`prefill_continue`, `background`, `ws_session`)."""
