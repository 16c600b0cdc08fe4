int main() { return 0; }  // placeholder, replaced by the launcher
