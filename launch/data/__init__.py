"""The data pipeline, read by the orchestrator's data step (``python -m launch.data.tool``) and by
every phase (``launch.data.examples``), apart from the phase's engine, switch and handover
(tests/test_layout.py): ``cache`` prepares a run's cache entry once, the mix of its sources
(``mix``); ``records`` reads a file, ``formats`` turns each format's records into one intermediate
form and tokenizes it, ``chat`` renders a conversation and finds its assistant turns (under
``template``'s budget; ``templates`` the named templates), ``rows`` lays the rows out; ``examples``
maps them in a phase and draws its micro-batches. See docs/data.md."""
