"""Engine-neutral checks both doctors share: facts of this host, judged the same way for either engine.

Each check takes values (never a variable name it reads itself) and returns findings; the engine
doctors gather their own launch facts and name their own knobs.
"""
