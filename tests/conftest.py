"""Settings for every test tier."""

from hypothesis import settings

# Property tests assert what holds, not how fast: a loaded CI machine must not fail them on time.
settings.register_profile("shard-operator", deadline=None)
settings.load_profile("shard-operator")
