"""The configuration: how an option is declared once (:mod:`.option`), the core options
(:mod:`.core`; each feature declares its own with its stage), the settings reader, the typed
:class:`~.options.Options` of a task, misspelled names, and the configuration page."""
