from exl3tools.cli import main

main()
