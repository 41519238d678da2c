def test_imports():
    import converters.cli  # noqa: F401
    import interop  # noqa: F401
    import trainers.base  # noqa: F401
