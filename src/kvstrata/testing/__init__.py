"""Test helpers shipped with kvstrata: a pytest plugin with fixtures for plugin authors."""
