"""The compiler: passes that turn a typed job graph into a placed, scheduled, verified plan."""
