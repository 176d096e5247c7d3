"""Pure domain rules: sandbox state machine, key hashing. No I/O, no clock."""
