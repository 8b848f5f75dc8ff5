"""The node's half of the bulk path: grants (:mod:`.grants`), the listener (:mod:`.listener`), the control calls
(:mod:`.operations`)."""
