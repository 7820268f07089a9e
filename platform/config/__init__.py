"""Job configuration: strict pydantic schemas (:mod:`.schemas`) and YAML loading with dotted overrides (:mod:`.load`)."""
